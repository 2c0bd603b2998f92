"""distlaunch.mpi: the mpi4py tutorial programs run under distlaunch with only the import
line changed, and print what the same programs print under real MPICH (mpi4py +
mpiexec, when installed)."""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, dl

EXAMPLES = ["mpi_bcast_dict", "mpi_scatter_list", "mpi_buffers", "mpi_send_recv"]
IMPORT = "from distlaunch import mpi as MPI"
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


def ours(name, n=3):
    res = dl("run", "--nproc-per-node", n, ROOT / "examples" / f"{name}.py", timeout=120)
    assert res.returncode == 0, res.stderr
    return sorted(re.sub(r"^\[\d+\]: ", "", ln) for ln in res.stdout.splitlines())


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_matches_mpich(name, tmp_path):
    mine = ours(name)
    assert mine, "the example printed nothing"
    pytest.importorskip("mpi4py")
    if not os.path.exists(MPIEXEC):
        pytest.skip("mpiexec (pip install mpich) is not installed")
    source = (ROOT / "examples" / f"{name}.py").read_text()
    assert IMPORT in source
    script = tmp_path / f"{name}.py"
    script.write_text(source.replace(IMPORT, "from mpi4py import MPI"))
    # Under mpiexec all ranks share one pipe: with PYTHONUNBUFFERED, print() writes text and
    # newline separately and lines of ranks interleave; buffered, flush=True writes once.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    res = subprocess.run(
        [MPIEXEC, "-n", "3", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    assert mine == sorted(res.stdout.splitlines())


def test_in_place_status_and_ops(tmp_path):
    script = tmp_path / "extra.py"
    script.write_text("""
import numpy as np
from distlaunch import mpi as MPI
comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
buf = np.array([rank + 1, 2 * rank + 1], dtype=np.int64)
comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.PROD)
expect = np.prod([[r + 1, 2 * r + 1] for r in range(size)], axis=0)
assert (buf == expect).all(), buf
flags = np.array([rank != 1], dtype=bool)
comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.LAND)
assert not flags[0]
assert comm.allreduce(rank, op=MPI.MAX) == size - 1
assert comm.reduce([rank], op=MPI.SUM, root=1) == (list(range(size)) if rank == 1 else None)
if rank == 0:
    comm.send("hi", dest=1, tag=3)
elif rank == 1:
    st = MPI.Status()
    assert comm.recv(source=MPI.ANY_SOURCE, tag=3, status=st) == "hi" and st.Get_source() == 0
sendbuf = np.arange(size * 2, dtype=np.float32) if rank == 0 else None
mine = np.empty(2, dtype=np.float32)
comm.Scatter(sendbuf, mine, root=0)
assert mine.tolist() == [2 * rank, 2 * rank + 1]
back = np.empty(size * 2, dtype=np.float32) if rank == 2 else None
comm.Gather(mine, back, root=2)
if rank == 2:
    assert back.tolist() == list(range(size * 2))
comm.Barrier()
MPI.Finalize()
print("ok")
""")
    res = dl("run", "--nproc-per-node", "3", script, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("ok") == 3


def test_mpi_import_stays_light():
    code = (
        "import sys; from distlaunch import mpi; "
        "print(sorted(m for m in ('click', 'psutil', 'paramiko', 'yaml', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stderr
