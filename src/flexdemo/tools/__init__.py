"""Tools around the library: the emulated multi-node cluster (:mod:`flexdemo.tools.cluster`,
with :mod:`~flexdemo.tools.netns`, :mod:`~flexdemo.tools.ranks` and :mod:`~flexdemo.tools.rates`).
Standard library only; the library never imports them."""

# the tools are imported by module (flexdemo.tools.cluster, ...)
__all__: list[str] = []
