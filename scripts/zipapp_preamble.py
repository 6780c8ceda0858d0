"""Run by txmq.pyz (shiv's --preamble) before txmq is imported: is this the Python it was built for?

The zipapp carries compiled modules (txmq's speed-ups, msgpack, uvloop,
grpcio, pydantic-core) built for one Python minor version. Under another,
the first import of one of them fails with an ImportError that does not
say why; this says so in one line and exits 2.
"""

import re
import sys
from importlib.util import find_spec
from pathlib import Path

spec = find_spec("txmq")
built = set()
if spec is not None and spec.origin:
    site = Path(spec.origin).parent.parent
    for f in (p for pkg in ("txmq", "msgpack", "uvloop") for p in (site / pkg).rglob("*.so")):
        m = re.search(r"\.cpython-(\d)(\d+)", f.name)
        if m:
            built.add((int(m.group(1)), int(m.group(2))))
running = sys.version_info[:2]
if built and running not in built:
    need = " or ".join(f"{a}.{b}" for a, b in sorted(built))
    print(f"error: this txmq.pyz was built for Python {need} (its compiled modules need it), not Python "
          f"{running[0]}.{running[1]}: run it with python{need.split(' ')[0]}, or build it under this Python with `make binary`",
          file=sys.stderr)
    sys.exit(2)
