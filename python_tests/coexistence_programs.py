"""Rank programs of test_nvshmem_coexistence_gpu.py: our nvshmem transport beside the NVSHMEM
other libraries of the process start (torch's symmetric memory, nvshmem4py). GPU only."""

from __future__ import annotations

import torch
import torch.distributed as dist

import freescale_comm as fc


def _our_alltoall(info, comm: fc.Communicator) -> tuple[bool, str]:
    """One AllToAll of CUDA tensors on the nvshmem transport: (right bytes?, its data path)."""
    world = info.world_size
    x = torch.arange(4 * world, dtype=torch.float32, device="cuda") + 1000 * info.rank
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x)
    torch.cuda.synchronize()
    want = torch.cat([torch.arange(4 * info.rank, 4 * info.rank + 4, dtype=torch.float32) + 1000 * src
                      for src in range(world)])
    return torch.equal(out.cpu(), want), comm.data_paths["cuda:0"]


def _torch_all_to_all_vdev(group_name: str, world: int, rank: int) -> bool:
    """torch's NVSHMEM AllToAllv (symm_mem.all_to_all_vdev): 4 rows from every rank to every rank."""
    import torch.distributed._symmetric_memory as symm_mem

    rows = 4
    inp = symm_mem.empty(rows * world, dtype=torch.float32, device="cuda")
    out = symm_mem.empty(rows * world, dtype=torch.float32, device="cuda")
    inp.copy_(torch.arange(rows * world, dtype=torch.float32, device="cuda") + 1000 * rank)
    symm_mem.rendezvous(inp, group=group_name)
    symm_mem.rendezvous(out, group=group_name)
    op = torch.ops.symm_mem.all_to_all_vdev
    if len(op.default._schema.arguments) == 5:  # torch >= 2.9: (input, out, in_splits, out_splits_offsets, group)
        in_splits = symm_mem.empty(world, dtype=torch.int64, device="cuda").fill_(rows)
        out_splits_offsets = symm_mem.empty((2, world), dtype=torch.int64, device="cuda")
        symm_mem.rendezvous(in_splits, group=group_name)
        symm_mem.rendezvous(out_splits_offsets, group=group_name)
        op(inp, out, in_splits, out_splits_offsets, group_name)
    else:  # earlier: (input, out, in_out_splits [3, world], group)
        splits = symm_mem.empty((3, world), dtype=torch.int64, device="cuda")
        splits[0].fill_(rows)
        symm_mem.rendezvous(splits, group=group_name)
        op(inp, out, splits, group_name)
    torch.cuda.synchronize()
    want = torch.cat([torch.arange(rows * rank, rows * rank + rows, dtype=torch.float32) + 1000 * src
                      for src in range(world)])
    return torch.equal(out.cpu(), want)


def torch_symmetric_memory_first(info) -> dict:
    """torch's symmetric memory starts NVSHMEM (its first symmetric allocation), then our
    communicator joins it (PE = global rank = our rank), then torch's all_to_all_vdev runs again."""
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(0)
    symm_mem.set_backend("NVSHMEM")
    group_name = dist.group.WORLD.group_name
    first = _torch_all_to_all_vdev(group_name, info.world_size, info.rank)
    comm = fc.Communicator()
    ours, path = _our_alltoall(info, comm)
    again = _torch_all_to_all_vdev(group_name, info.world_size, info.rank)
    comm.close()
    return {"torch first": first, "ours": ours, "joined": "already running in this process" in path,
            "torch again": again}


def ours_first_then_nvshmem4py(info) -> dict:
    """Our communicator starts NVSHMEM, then nvshmem4py initializes (by unique id, as its docs
    show: NVSHMEM only counts a reference, our runtime serves it), allocates a symmetric tensor
    and puts into the next PE, then finalizes: our runtime must stay usable (its count)."""
    import numpy as np
    import nvshmem.core as nvshmem  # the test skips when nvshmem4py is not installed
    from cuda.core.experimental import Device

    torch.cuda.set_device(0)
    comm = fc.Communicator()
    ours, path = _our_alltoall(info, comm)
    dev = Device(0)
    dev.set_current()
    stream = dev.create_stream()
    uid = nvshmem.get_unique_id(empty=info.rank != 0)
    blob = [uid._data.view(np.int8).tobytes() if info.rank == 0 else None]
    dist.broadcast_object_list(blob, src=0)
    uid._data.view(np.int8)[:] = np.frombuffer(blob[0], dtype=np.int8)
    nvshmem.init(device=dev, uid=uid, rank=info.rank, nranks=info.world_size, initializer_method="uid")
    t = nvshmem.tensor((4,), dtype=torch.float32)
    t.fill_(float(info.rank))
    torch.cuda.synchronize()
    dist.barrier()
    nvshmem.put(t, t, remote_pe=(info.rank + 1) % info.world_size, stream=stream)
    stream.sync()
    dist.barrier()
    got = t.cpu().tolist()
    nvshmem.free_tensor(t)
    nvshmem.finalize()
    again, _ = _our_alltoall(info, comm)  # our runtime outlives nvshmem4py's finalize (a reference less)
    comm.close()
    return {"ours": ours, "started by us": "already running" not in path,
            "put landed": got == [float((info.rank - 1) % info.world_size)] * 4, "ours after": again}
