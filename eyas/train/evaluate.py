"""Acceptance while training: the held-out split, teacher-forced, and the acceptance length it implies.

    stats = eval_stats(draft, batch, head_rows, num_steps=4, chain_steps=3)   # sums of one batch (all-reducible)
    summary = summarize_eval(summed, chain_steps=3, decay=0.8, num_ttt_steps=4)   # {"acc_k", "tau_estimate", ...}

Every `train.eval_every_steps` and at every checkpoint the trainer runs the draft over the held-out samples
(eyas.train.data.held_out_ids) with the training unroll (`Eagle3Draft.unroll`, no gradient), for
max(train.num_ttt_steps, chain) steps. Step k at index t is fed the real tokens and the draft's own hidden
states of steps 0..k-1, and predicts the token k + 1 positions after the one step 0 predicts.

How tau is estimated: by replaying the reference engine's verification rounds over each held-out response.
Greedy verification of a chain of S drafted tokens accepts draft token k exactly when tokens 0..k-1 were
accepted and the draft's top-1 at step k equals the target's top-1. Once tokens 0..k-1 were accepted, the draft
at inference has exactly the inputs the unroll gives step k at index t (the same tokens, its own hidden states),
so the chain started at index t accepts L_t = the number of leading steps whose top-1 equals the teacher's
(a masked position ends the run; so does a sample token that is not the teacher's top-1, a sampled rather than
greedy response, because the unroll's next step is fed that token and the engine the drafted one). The replay
walks each response as `eyas.bench.reference.reference_decode` does: its first token comes from the prefill,
then each round at index t emits min(L_t, S) + 1 tokens (cut at the response's end) and the next round starts
after them. tau_estimate = emitted tokens / rounds, over all held-out responses, and accept_rate_k the fraction
of rounds accepting draft token k: the benchmark's own definitions (eyas.bench.reference), on the held-out
split's responses instead of the benchmark's prompts. It equals the measured tau when the responses are the
target's greedy continuations and the benchmark's prompts are like the training prompts. `acc_k` is the plain
teacher-forced accuracy of step k (every masked-in index, not conditioned on earlier steps), as in the training
metrics. The teacher is the target's distribution over the draft vocab, so where the target's top-1 lies outside
the draft vocab the draft vocab's best one counts: the estimate is high by the share of such positions.
"""

from __future__ import annotations

import torch

from eyas.draft import Eagle3Draft
from eyas.objective import teacher_probs

EVAL_KEYS = ("correct", "counts", "loss_sum", "round_hist", "emitted")


def simulate_rounds(run_length: torch.Tensor, mask: torch.Tensor, chain_steps: int) -> tuple[list[int], int]:
    """Greedy chain verification replayed over each response of the batch: (rounds per accepted count
    0..chain_steps, tokens emitted). `mask` [B, L] marks the trained positions; a response is a run of them."""
    hist, emitted = [0] * (chain_steps + 1), 0
    for row, (lengths, marks) in enumerate(zip(run_length.tolist(), mask.tolist())):
        j, n = 0, len(marks)
        while j < n:
            if not marks[j]:
                j += 1
                continue
            end = j
            while end + 1 < n and marks[end + 1]:
                end += 1
            # positions j..end predict x_{j+1}..x_{end+1}; x_{j+1} comes from the prefill, the rounds emit the rest
            t, last = j, end + 1
            while t + 1 < last and t < len(lengths):
                accepted = min(lengths[t], chain_steps)
                out = min(accepted + 1, last - (t + 1))
                hist[accepted] += 1
                emitted += out
                t += out
            j = end + 1
    return hist, emitted


def eval_stats(
    draft: Eagle3Draft, batch: dict, head_rows: torch.Tensor, num_steps: int, chain_steps: int
) -> dict[str, torch.Tensor]:
    """Sums over one batch: correct[k] and counts[k] (top-1 hits and masked-in indices of step k), loss_sum[k]
    (soft cross-entropy), round_hist[a] (replayed verification rounds that accepted a drafted tokens, a =
    0..chain_steps) and emitted (the tokens those rounds emitted); num_steps >= chain_steps."""
    ids, valid = batch["input_ids"], batch["valid"]
    with torch.no_grad():
        target_p, has_mass = teacher_probs(batch, head_rows, draft.t2d)
        mask = batch["loss_mask"].bool() & has_mass & valid
        tlen = ids.shape[1] - 1
        correct, counts, loss_sum = [], [], []
        running = torch.ones(ids.shape[0], tlen, dtype=torch.bool, device=ids.device)  # the chain so far
        run_length = torch.zeros(ids.shape[0], tlen, dtype=torch.int64, device=ids.device)
        for k, logits in draft.unroll(ids, batch["aux_hidden"].float(), num_steps, valid):
            span = max(tlen - k, 0)
            tgt = target_p[:, k + 1 : k + 1 + span]
            m = mask[:, k + 1 : k + 1 + span]
            lg = logits[:, :span].float()
            best = tgt.argmax(-1)
            hit = (lg.argmax(-1) == best) & m
            ce = -(tgt * torch.log_softmax(lg, -1)).sum(-1)
            correct.append(hit.sum())
            counts.append(m.sum())
            loss_sum.append((ce * m).sum())
            step_hit, follows = torch.zeros_like(running), torch.zeros_like(running)
            step_hit[:, :span] = hit
            # the next step is fed the sample's token: it is the drafted one only where that is the teacher's top-1
            nxt = min(span, max(ids.shape[1] - (k + 2), 0))
            follows[:, :nxt] = ids[:, k + 2 : k + 2 + nxt] == draft.to_target_ids(best[:, :nxt])
            accepted = running & step_hit
            run_length += accepted
            running = accepted & follows
        hist, emitted = simulate_rounds(run_length.cpu(), mask.cpu(), chain_steps)
    return {
        "correct": torch.stack(correct).double(),
        "counts": torch.stack(counts).double(),
        "loss_sum": torch.stack(loss_sum).double(),
        "round_hist": torch.tensor(hist, dtype=torch.float64, device=ids.device),
        "emitted": torch.tensor([emitted], dtype=torch.float64, device=ids.device),
    }


def add_stats(total: dict | None, stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if total is None:
        return {k: stats[k].detach().cpu().clone() for k in EVAL_KEYS}
    return {k: total[k] + stats[k].detach().cpu() for k in EVAL_KEYS}


def summarize_eval(total: dict[str, torch.Tensor], chain_steps: int, decay: float, num_ttt_steps: int) -> dict:
    """The metric record's `eval` entry from summed (all-reduced) stats; `loss` weighs the first num_ttt_steps
    steps as the training loss does, so the two compare."""
    counts = total["counts"].clamp(min=1.0)
    loss_k = (total["loss_sum"] / counts).tolist()
    hist = total["round_hist"].tolist()
    rounds = sum(hist)
    if rounds <= 0:
        raise ValueError(
            "held-out evaluation: no verification round could be replayed (no held-out response of two or more "
            "trained tokens); raise train.eval_fraction"
        )
    return {
        "acc_k": (total["correct"] / counts).tolist(),
        "loss": sum(decay**k * v for k, v in enumerate(loss_k[:num_ttt_steps])),
        "loss_k": loss_k,
        "tau_estimate": float(total["emitted"][0]) / rounds,
        "accept_rate_k": [sum(hist[a + 1 :]) / rounds for a in range(chain_steps)],
        "chain_steps": chain_steps,
        "num_rounds": int(rounds),
        "num_tokens": int(total["counts"][0]),
    }
