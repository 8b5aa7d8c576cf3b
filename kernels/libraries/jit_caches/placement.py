"""Whether a restored JIT cache unit is still where its library looks: ``status`` and ``verify`` ask it.

jitwarm's store holding a unit proves nothing about the server's start: the library reads its own directory. A
restored ``.so`` deleted from Inductor's directory still showed "18/18 present" while the start compiled it again.
The directory is the one the restore wrote to (``library.root`` under the unit's server, inside
:func:`~.units.placed_by`), each file compared by its stored bytes' digest (``Library.stored_bytes``).
"""

from __future__ import annotations

import hashlib

from jitwarm.kernels.backend import SpecError
from jitwarm.kernels.libraries.jit_caches.backend import unit_of
from jitwarm.kernels.libraries.jit_caches.units import Library, dirs_under
from jitwarm.kernels.spec import KernelSpec


def problems(library: Library, spec: KernelSpec) -> list[str]:
    """Why the restored unit of ``spec`` is not where ``library`` looks, one line a file; empty when it is.

    Call it inside :func:`~.units.placed_by` (a unit recorded under a server); never raises OSError. A library
    switched off here (no directory) reports nothing: its server will not look.
    """
    try:
        files, _, under = unit_of(library, spec)
        root = library.root(None, dirs_under(under))
    except (SpecError, RuntimeError) as exc:
        return [f"cannot tell where it goes: {exc}"]
    if root is None:
        return []
    rules = library.part(spec.family)
    found = []
    for rel, digest in sorted(files.items()):
        path = root / rel
        try:
            data = rules.stored_bytes(root, rel)
        except FileNotFoundError:
            found.append(f"missing at {path}")
            continue
        except OSError as exc:
            found.append(f"unreadable at {path}: {exc.strerror or exc}")
            continue
        except (ValueError, KeyError, TypeError, AttributeError):
            data = b""  # not in the library's format any more: changed
        # The driver's PTX cache (unit ".") rewrites its index as it runs: there presence is what can be told.
        if spec.family != "." and hashlib.sha256(data).hexdigest() != digest:
            found.append(f"changed at {path}")
    return found

