"""corral doctor's smoke test: node-to-node TCP, then one checked all-reduce.

Run by torchrun (through `corral doctor`), never imported by corral.

First, one process per node opens a TCP listener on the address corral
verified for it (CORRAL_NODE_IPS) and connects to every other node's, meeting
through the rendezvous store; a failed connection is reported as the link
it is (``node2 cannot reach node3``) instead of an all-reduce that hangs until
its timeout.  Then each rank contributes rank+1 to an all-reduce; every rank
must hold world*(world+1)/2.  Rank 0 prints lines the head reads:

    CORRAL_SMOKE {"links": []}
    CORRAL_SMOKE {"backend": "gloo", "world_size": 8, "seconds": 0.4, "hosts": [...]}

Environment: CORRAL_SMOKE_BACKEND (gloo|nccl, default: nccl when CUDA is
available), CORRAL_SMOKE_TIMEOUT (seconds for init and the collective).
"""

import datetime
import json
import os
import socket
import sys
import threading
import time

import torch
import torch.distributed as dist


def link_check(wait: float = 5.0) -> list:
    """Every node connects to every other node's listener; all nodes' failures, for every rank."""
    hosts = os.environ["CORRAL_HOSTS"].split(",")
    ips = os.environ["CORRAL_NODE_IPS"].split(",")
    node = int(os.environ["CORRAL_NODE_RANK"])
    prefix = f"corral-smoke/{os.environ.get('CORRAL_RUN_ID', 'run')}/"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=datetime.timedelta(seconds=120))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.bind((ips[node], 0))
        except OSError:
            listener.bind(("0.0.0.0", 0))
        listener.listen(64)
        threading.Thread(target=_accept, args=(listener,), daemon=True).start()
        store.set(f"{prefix}addr/{node}", f"{ips[node]}:{listener.getsockname()[1]}")
        failures = []

        def connect(peer: int) -> None:
            addr, port = store.get(f"{prefix}addr/{peer}").decode().rsplit(":", 1)
            try:
                socket.create_connection((addr, int(port)), timeout=wait).close()
            except OSError as e:
                why = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e))
                failures.append({"src": hosts[node], "dst": hosts[peer], "address": f"{addr}:{port}",
                                 "error": why})

        threads = [threading.Thread(target=connect, args=(p,)) for p in range(len(hosts)) if p != node]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        store.set(f"{prefix}links/{node}", json.dumps(failures))
    results = [json.loads(store.get(f"{prefix}links/{n}")) for n in range(len(hosts))]
    return [f for r in results for f in r]


def _accept(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.close()


def host_names(world: int, device: "torch.device") -> list:
    """Every rank's host name, gathered as a tensor of its bytes.

    Not all_gather_object: it needs numpy on every node (a node without it
    failed the smoke test with torch's bare "Numpy is not available"), and a
    smoke test checks the collective, not the node's numpy."""
    name = socket.gethostname().encode()[:255]
    mine = torch.zeros(256, dtype=torch.int32)
    mine[0] = len(name)
    if name:
        mine[1:1 + len(name)] = torch.tensor(list(name), dtype=torch.int32)
    gathered = [torch.zeros_like(mine, device=device) for _ in range(world)]
    dist.all_gather(gathered, mine.to(device))
    out = []
    for t in gathered:
        values = t.cpu().tolist()
        out.append(bytes(values[1:1 + values[0]]).decode(errors="replace"))
    return out


def main() -> int:
    backend = os.environ.get("CORRAL_SMOKE_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=float(os.environ.get("CORRAL_SMOKE_TIMEOUT", "60")))
    started = time.time()
    failures = link_check()
    if int(os.environ.get("RANK", "0")) == 0:
        print("CORRAL_SMOKE " + json.dumps({"links": failures}), flush=True)
    me = os.environ["CORRAL_HOSTS"].split(",")[int(os.environ["CORRAL_NODE_RANK"])]
    mine = [f for f in failures if f["src"] == me]
    if mine and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        f = mine[0]
        raise RuntimeError("{} cannot open a TCP connection to {} at {}: {}".format(
            f["src"], f["dst"], f["address"], f["error"]))
    if failures:
        return 0  # another node's link is broken; that node reports it
    dist.init_process_group(backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    value = torch.full((1 << 16,), float(rank + 1), device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    got = value.cpu()
    if not bool((got == expected).all()):
        print(f"all-reduce returned {got[0].item()} on rank {rank}, expected {expected}",
              file=sys.stderr, flush=True)
        return 1
    # Which host each rank ran on, so the head can tell ranks from nodes.
    hosts = host_names(world, device)
    dist.barrier()
    if rank == 0:
        print("CORRAL_SMOKE " + json.dumps({
            "backend": backend, "world_size": world, "seconds": round(time.time() - started, 3),
            "hosts": hosts, "torch": torch.__version__,
        }), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
