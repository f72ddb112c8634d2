"""``flexdemo train``: the trainer, its set-up, checkpoints, heartbeats and preemption."""

__all__: list[str] = []
