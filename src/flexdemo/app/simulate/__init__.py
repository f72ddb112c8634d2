"""``flexdemo simulate``: N replicas of the GPT task in one process."""

__all__: list[str] = []
