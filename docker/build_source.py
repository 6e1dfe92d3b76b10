"""Copy the part of hvdp that builds Horovod: python build_source.py SRC DEST.

SRC holds hvdp/. DEST gets the modules that ``import hvdp.horovod_build.build`` loads (the package's
own __init__ left empty, so the facade and its imports are not needed) and hvdp/horovod_build/inserted/,
the text the build inserts into Horovod. The images build Horovod from DEST alone, so their
Horovod layer is rebuilt only when one of these files changes, not on any change to hvdp/.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

DATA = ["hvdp/horovod_build/inserted"]


def main(src: Path, dest: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        shutil.copytree(src / "hvdp", scratch / "hvdp", ignore=shutil.ignore_patterns("__pycache__"))
        (scratch / "hvdp" / "__init__.py").write_text("")
        sys.path.insert(0, str(scratch))
        import hvdp.horovod_build.build  # noqa: F401  (what it imports is what the build needs)

        used = sorted({Path(m.__file__).resolve() for m in list(sys.modules.values())
                       if getattr(m, "__file__", None) and Path(m.__file__).resolve().is_relative_to(scratch)})
        for path in used:
            relative = path.relative_to(scratch)
            (dest / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / relative, dest / relative)
        (dest / "hvdp" / "__init__.py").write_text("")
        for folder in DATA:
            shutil.copytree(src / folder, dest / folder, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        # The same files give the same layer: no time of this copy is left in it (an engine that
        # digests metadata, as podman 4's does, would otherwise never reuse the Horovod layer).
        for path in [*dest.rglob("*"), dest]:
            os.utime(path, (0, 0), follow_symlinks=False)
        for path in sorted(dest.rglob("*.py")):
            print(path.relative_to(dest))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
