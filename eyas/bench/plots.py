"""PNG figures of a benchmark result: acceptance per draft position, and tau over prompts.

Use: `acceptance_figure(result).savefig("run/bench/acceptance.png")`.
"""

from __future__ import annotations


def acceptance_figure(result: dict):
    """A matplotlib Figure (Agg backend): left, acceptance rate per position for the trained draft and the
    baselines the result holds; right, the histogram of tau per prompt with the pooled taus marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.4))
    series = [("eyas draft", "accept_rate_per_position"), ("n-gram", "accept_rate_per_position_ngram")]
    series.append(("random draft", "accept_rate_per_position_random"))
    present = [(label, result[key]) for label, key in series if result.get(key)]
    width = 0.8 / max(len(present), 1)
    for j, (label, rates) in enumerate(present):
        ax1.bar([i + 1 + (j - (len(present) - 1) / 2) * width for i in range(len(rates))], rates, width, label=label)
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("acceptance rate")
    ax1.set_ylim(0, 1)
    if present:
        ax1.legend(fontsize=8)
    taus = [t for t in result.get("tau_per_prompt", []) if t is not None]
    ax2.hist(taus, bins=12, color="tab:blue", alpha=0.8)
    for label, key, colour in (("eyas", "tau_mean", "tab:blue"), ("n-gram", "tau_ngram", "tab:orange")):
        if result.get(key) is not None:
            ax2.axvline(result[key], color=colour, ls="--", label=f"{label} {result[key]:.2f}")
    if result.get("tau_random") is not None:
        ax2.axvline(result["tau_random"], color="tab:green", ls=":", label=f"random {result['tau_random']:.2f}")
    ax2.set_xlabel(f"tau per prompt ({result.get('engine', 'reference')} engine)")
    ax2.set_ylabel("prompts")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig
