"""``flexdemo bench``: the strategy x bandwidth sweep, its elastic runs, links, report and plots."""

__all__: list[str] = []
