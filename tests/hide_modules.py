"""`python hide_modules.py MOD[,MOD...] ARGS...`: run `medbanana ARGS...` (or `-m MODULE ARGS...`) as if the named
top-level modules were not installed. `sys.modules[name] = None` is what Python itself uses for a module that must
not be imported: `import name` raises ModuleNotFoundError and `importlib.util.find_spec(name)` returns None."""

import runpy
import sys

for name in sys.argv[1].split(","):
    sys.modules[name] = None
args = sys.argv[2:]
if args[0] == "-m":
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)
else:
    from medbanana.cli import main

    sys.exit(main(args))
