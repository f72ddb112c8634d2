"""Tools around the library: the emulated multi-node cluster (:mod:`flexdemo.tools.cluster`).
Standard library only; the library never imports them."""
