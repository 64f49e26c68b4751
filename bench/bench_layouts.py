"""What the scripts that run train-gpt layouts by name share (capacity, plan-time): a
strategy's train-gpt flags and rtp-plan's name of its layout. Strategies: none (one
process), ddp, fsdp, rtp, tp, or ppS-<strategy> (S stages of that strategy inside)."""


def strategy_flags(strategy):
    """train-gpt's flags for the strategy."""
    if strategy.startswith("pp"):
        stages, inner = strategy[2:].split("-", 1)
        return ["--pp", stages] + ([] if inner == "none" else ["--strategy", inner])
    return [] if strategy == "none" else ["--strategy", strategy]


def layout_name(strategy, ranks):
    """rtp-plan's name of the strategy's layout on `ranks` ranks."""
    if strategy == "none":
        return "one process"
    if strategy.startswith("pp"):
        stages, inner = strategy[2:].split("-", 1)
        per = ranks // int(stages)
        return f"pp {stages}" if per == 1 else f"pp {stages} x {inner} {per}"
    return strategy
