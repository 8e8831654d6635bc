"""A plain torch.distributed program on the "freescale" backend:

    torchrun --standalone --nproc-per-node 4 examples/torchrun_backend.py

It imports freescale_comm only to register the backend; everything else is dist.* calls. Each
rank checks its results against values computed locally and prints "rank ok"."""

import torch
import torch.distributed as dist

import freescale_comm  # noqa: F401 - registers the "freescale" backend


def main() -> None:
    dist.init_process_group("freescale")
    rank, world = dist.get_rank(), dist.get_world_size()

    # Uneven all_to_all_single: rank r sends (r + p + 1) rows of value 100 r + p to rank p.
    send = torch.cat([torch.full((rank + p + 1, 4), float(100 * rank + p)) for p in range(world)])
    recv = torch.empty(sum(p + rank + 1 for p in range(world)), 4)
    dist.all_to_all_single(recv, send, [p + rank + 1 for p in range(world)], [rank + p + 1 for p in range(world)])
    expected = torch.cat([torch.full((p + rank + 1, 4), float(100 * p + rank)) for p in range(world)])
    assert torch.equal(recv, expected), "all_to_all_single"

    outs = [torch.empty(2, dtype=torch.int64) for _ in range(world)]
    dist.all_to_all(outs, [torch.tensor([rank, p]) for p in range(world)])
    assert all(o.tolist() == [p, rank] for p, o in enumerate(outs)), "all_to_all"

    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    assert total.item() == world * (world - 1) / 2, "all_reduce"

    names = [None] * world
    dist.all_gather_object(names, f"rank{rank}")
    assert names == [f"rank{p}" for p in range(world)], "all_gather_object"

    works = [dist.all_to_all_single(torch.empty(world), torch.full((world,), float(i)), async_op=True) for i in range(4)]
    for i, w in enumerate(works):
        w.wait()
        assert torch.equal(w.result()[0], torch.full((world,), float(i))), "async all_to_all_single"

    dist.barrier()
    print(f"torchrun_backend: rank ok ({rank}/{world})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
