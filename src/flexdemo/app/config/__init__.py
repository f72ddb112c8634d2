"""The training configuration: its sections (schema), reading and writing (files), checks."""

__all__: list[str] = []
