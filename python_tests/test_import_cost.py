"""What `import freescale_comm` loads (counted in sys.modules, not timed): torch.compiler.disable
at import pulled in torch._dynamo, 1.2 s of CPU in every process that imports the package, a CLI
or a planner that never calls a collective among them."""
import subprocess
import sys

PROGRAM = ("import sys, torch, torch.distributed\n"
           "before = 'torch._dynamo' in sys.modules\n"
           "import freescale_comm, freescale_comm.planner, freescale_comm.testing\n"
           "print(before, 'torch._dynamo' in sys.modules)\n")


def test_importing_the_package_loads_no_dynamo_that_torch_distributed_did_not():
    out = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    before, after = out.stdout.split()
    assert after == before, f"torch._dynamo loaded by torch.distributed: {before}, after freescale_comm: {after}"
