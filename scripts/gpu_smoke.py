"""One rank, one CUDA AllToAll through a freescale Communicator, each step named on stdout: the
first thing a lent GPU runs (scripts/gpu_checklist.sh), so that a crash shows where it happened
(run it under `python3 -X faulthandler`, or under cuda-gdb for the native stack).
Usage: python3 scripts/gpu_smoke.py [MASTER_PORT]   (FREESCALE_TRANSPORT=nvshmem for that path)"""
import os
import sys

import torch
import torch.distributed as dist

import freescale_comm as fc


def main() -> int:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1] if len(sys.argv) > 1 else "29511")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.cuda.set_device(0)
    print("step: Communicator()", flush=True)
    comm = fc.Communicator()
    x = torch.arange(8, dtype=torch.float32, device="cuda")
    y = torch.empty_like(x)
    print("step: all_to_all_single on cuda:0", flush=True)
    comm.all_to_all_single(y, x)
    torch.cuda.synchronize()
    ok = torch.equal(x, y)
    print(f"{'ok' if ok else 'WRONG'}: {comm.data_paths}", flush=True)
    comm.close()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
