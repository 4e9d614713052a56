"""The checks of bench/gpu_truth.py, one module per concern: the runner (budgets, time limits, results), the
shapes (Kimi-K2.5's draft, or tiny ones for --quick), and the checks themselves."""
