"""torchft's lighthouse, as the wheel's ``torchft_lighthouse`` script runs it, without the torch
import: ``python lighthouse_script.py --bind HOST:PORT --min_replicas N ...`` (what
``flexdemo lighthouse`` and the elastic bench run; :func:`flexdemo.ft.lighthouse.launcher`).

That script imports ``torchft._torchft`` through the ``torchft`` package, which imports torch
(about 1.5 s of CPU before the lighthouse listens, 30 s on a loaded 2-core machine); this loads
the extension module alone and calls the same ``lighthouse_main``, which parses this process's
command line as the script's (the first argument, this file, stands for the program's name).
Run by its path, it imports nothing of flexdemo either.
"""

import glob
import importlib.machinery
import importlib.util
import os
import sys

if __name__ == "__main__":
    package = importlib.util.find_spec("torchft")  # found, not imported
    if package is None or not package.submodule_search_locations:
        sys.exit("torchft is not installed")
    found = glob.glob(os.path.join(package.submodule_search_locations[0], "_torchft*.so"))
    if not found:
        sys.exit("torchft's extension module _torchft is not installed")
    loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", found[0])
    spec = importlib.util.spec_from_file_location("torchft._torchft", found[0], loader=loader)
    assert spec is not None
    ext = importlib.util.module_from_spec(spec)
    loader.exec_module(ext)
    sys.exit(ext.lighthouse_main())
