"""Launch planning is pure: every launcher's per-node argv/env, checked exactly."""

from __future__ import annotations

import base64
import json

import pytest

from corral.errors import UsageError
from corral.model import Cluster, Host
from corral.run.plan import NodeFacts, RunSpec, build_plan, env_from_head, parse_env_flags


def cluster(n: int = 2, slots: int | None = 2, **kw) -> Cluster:
    return Cluster(hosts=tuple(Host(name=f"node{i + 1}", slots=slots, python="/opt/py/bin/python")
                               for i in range(n)), **kw)


def plan(spec: RunSpec, c: Cluster | None = None, **kw):
    c = c or cluster()
    facts = kw.pop("facts", {h.name: NodeFacts() for h in c.hosts})
    return build_plan(c, spec, facts, master_addr="10.0.0.1", master_port=29400,
                      head_env=kw.pop("head_env", {}), head_cwd="/home/me/proj")


def test_torchrun_explicit_node_ranks() -> None:
    p = plan(RunSpec(program="train.py", args=("--lr", "1e-3"), run_id="r1"))
    assert [n.argv for n in p.nodes] == [
        ("/opt/py/bin/python", "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={r}",
         "--nproc-per-node=2", "--master-addr=10.0.0.1", "--master-port=29400", "--max-restarts=0",
         "train.py", "--lr", "1e-3")
        for r in (0, 1)
    ]
    assert [list(n.ranks) for n in p.nodes] == [[0, 1], [2, 3]]
    assert p.world_size == 4
    assert all(n.pipe_rank is None and n.requires == "torch" for n in p.nodes)


def test_env_contract() -> None:
    p = plan(RunSpec(program="train.py", run_id="r1"))
    env = p.nodes[1].env
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29400"
    assert env["NODE_RANK"] == "1" and env["NNODES"] == "2" and env["WORLD_SIZE"] == "4"
    assert env["CORRAL_RUN_ID"] == "r1" and env["CORRAL_HOSTS"] == "node1,node2"
    assert env["CORRAL_NPROC_PER_NODE"] == "2"


def test_module_and_cwd() -> None:
    p = plan(RunSpec(program="pkg.train", module=True, run_id="r"))
    assert p.nodes[0].argv[-2:] == ("-m", "pkg.train") and p.nodes[0].cwd == "/home/me/proj"
    p = plan(RunSpec(program="t.py", workdir="/srv/x", run_id="r"))
    assert {n.cwd for n in p.nodes} == {"/srv/x"}


def test_accelerate_plan() -> None:
    p = plan(RunSpec(program="train.py", launcher="accelerate", run_id="r"),
             facts={"node1": NodeFacts(gpus=2), "node2": NodeFacts(gpus=2)})
    argv = p.nodes[1].argv
    assert argv[:3] == ("/opt/py/bin/python", "-m", "accelerate.commands.launch")
    joined = " ".join(argv)
    assert "--num_machines 2 --machine_rank 1 --num_processes 4" in joined
    assert "--main_process_ip 10.0.0.1 --main_process_port 29400" in joined
    assert "--multi_gpu" in argv and argv[-1] == "train.py"
    cpu = plan(RunSpec(program="train.py", launcher="accelerate", run_id="r"))
    assert "--multi_gpu" in cpu.nodes[0].argv and cpu.nodes[0].env["ACCELERATE_USE_CPU"] == "1"


def test_accelerate_on_several_nodes_keeps_corrals_node_ranks() -> None:
    """A config's ``rdzv_backend: c10d`` would give node ranks out in order of
    arrival; corral says ``static`` on several nodes (accelerate's default)."""
    def has_static(p) -> list[bool]:
        return [" --rdzv_backend static " in " ".join(n.argv) for n in p.nodes]

    assert has_static(plan(RunSpec(program="train.py", launcher="accelerate", run_id="r"))) == [True, True]
    assert has_static(plan(RunSpec(program="train.py", launcher="accelerate", run_id="r"), cluster(1))) == [False]


def test_torchrun_tells_accelerate_a_cpu_only_node_is_one() -> None:
    """Accelerate (and the transformers Trainer) under torchrun on a node
    without GPUs make every rank a world of its own unless ACCELERATE_USE_CPU
    says the node is a CPU one; with GPUs, or one process in all, it stays unset."""
    cpu = plan(RunSpec(program="train.py", run_id="r"))
    assert all(n.env["ACCELERATE_USE_CPU"] == "1" for n in cpu.nodes)
    gpu = plan(RunSpec(program="train.py", run_id="r"),
               facts={"node1": NodeFacts(gpus=2), "node2": NodeFacts(gpus=2)})
    assert all("ACCELERATE_USE_CPU" not in n.env for n in gpu.nodes)


def test_accelerate_keeps_the_mode_the_user_chose(tmp_path) -> None:
    """--multi_gpu would override a config's FSDP/DeepSpeed (accelerate reads
    distributed_type only when no mode flag is given): corral adds it only
    when the user chose no mode."""
    def argv(*launcher_args: str) -> tuple[str, ...]:
        spec = RunSpec(program="train.py", launcher="accelerate", run_id="r", launcher_args=launcher_args)
        return plan(spec, facts={"node1": NodeFacts(gpus=2), "node2": NodeFacts(gpus=2)}).nodes[0].argv

    fsdp = tmp_path / "fsdp.yaml"
    fsdp.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n")
    ddp = tmp_path / "ddp.yaml"
    ddp.write_text("distributed_type: MULTI_GPU\nmixed_precision: bf16\n")
    ds_json = tmp_path / "ds.json"
    ds_json.write_text('{"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2}}')
    assert "--multi_gpu" not in argv(f"--config_file={fsdp}")
    assert "--multi_gpu" not in argv("--config-file", str(ds_json))
    assert "--multi_gpu" not in argv("--use_deepspeed") and "--multi_gpu" not in argv("--use-fsdp")
    assert argv("--multi_gpu").count("--multi_gpu") == 1
    assert "--multi_gpu" in argv(f"--config_file={ddp}")
    assert "--multi_gpu" in argv("--config_file=missing.yaml", "--mixed_precision=bf16")
    # the node's own default_config.yaml (read by preflight) says FSDP: accelerate applies it
    spec = RunSpec(program="train.py", launcher="accelerate", run_id="r")
    fsdp_default = {"node1": NodeFacts(gpus=2, accelerate_mode="FSDP"), "node2": NodeFacts(gpus=2, accelerate_mode="FSDP")}
    assert "--multi_gpu" not in plan(spec, facts=fsdp_default).nodes[0].argv
    spec = RunSpec(program="train.py", launcher="accelerate", run_id="r", launcher_args=(f"--config_file={ddp}",))
    assert "--multi_gpu" in plan(spec, facts=fsdp_default).nodes[0].argv  # an explicit config wins


def test_accelerate_deepspeed_on_several_nodes_launches_per_node(tmp_path) -> None:
    """accelerate's DeepSpeed mode defaults to (or is configured for) pdsh,
    which fans the whole job out from each node it runs on: corral starts it
    on every node, so each must start only its own processes (torchrun)."""
    config = tmp_path / "accelerate_config.yaml"
    config.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: DEEPSPEED\n"
                      "deepspeed_config:\n  deepspeed_multinode_launcher: pdsh\n  zero_stage: 2\n")
    per_node = ("--deepspeed_multinode_launcher", "standard")

    def argvs(c: Cluster, *launcher_args: str, mode: str | None = None) -> list[tuple[str, ...]]:
        spec = RunSpec(program="train.py", launcher="accelerate", run_id="r", launcher_args=launcher_args)
        facts = {h.name: NodeFacts(gpus=2, accelerate_mode=mode) for h in c.hosts}
        return [n.argv for n in plan(spec, c, facts=facts).nodes]

    def has(argv: tuple[str, ...]) -> bool:
        return any(argv[i:i + 2] == per_node for i in range(len(argv)))

    three = cluster(3)
    for launched in (argvs(three, f"--config_file={config}"), argvs(three, "--use_deepspeed"),
                     argvs(three, mode="DEEPSPEED")):  # the node's own default config
        assert all(has(a) for a in launched) and not any("--multi_gpu" in a for a in launched)
    assert not any(has(a) for a in argvs(cluster(1), f"--config_file={config}"))  # one node: no fan-out
    assert not any(has(a) for a in argvs(three) + argvs(three, "--use_fsdp"))


@pytest.mark.parametrize("arg", ["--deepspeed_multinode_launcher=pdsh", "--deepspeed-hostfile=/job/hostfile"])
def test_accelerates_own_fan_out_is_refused(arg: str) -> None:
    from corral.run.launchers import refuse_owned_options

    with pytest.raises(UsageError, match="conflicts with what corral sets up for accelerate"):
        refuse_owned_options("accelerate", (arg,))


def test_contract_variables_in_script_arguments_are_expanded_per_node() -> None:
    """`--dist-url tcp://$MASTER_ADDR:$MASTER_PORT --machine-rank $NODE_RANK`, as
    detectron2-style scripts are launched; nothing else is touched."""
    spec = RunSpec(program="python", launcher="command", run_id="r", args=(
        "train_net.py", "--dist-url", "tcp://$MASTER_ADDR:$MASTER_PORT", "--machine-rank", "${NODE_RANK}",
        "--num-machines", "$NNODES", "--keep", "$HOME/$NODE_RANKS", "cost=$5", "\\$NODE_RANK"))
    p = plan(spec)
    assert [n.argv[-10:] for n in p.nodes] == [
        ("train_net.py", "--dist-url", "tcp://10.0.0.1:29400", "--machine-rank", str(rank),
         "--num-machines", "2", "--keep", "$HOME/$NODE_RANKS", "cost=$5", "$NODE_RANK")[-10:]
        for rank in (0, 1)]


def test_deepspeed_plan_world_info() -> None:
    p = plan(RunSpec(program="train.py", launcher="deepspeed", run_id="r"))
    argv = p.nodes[1].argv
    assert argv[:4] == ("/opt/py/bin/python", "-u", "-m", "deepspeed.launcher.launch")
    info = next(a for a in argv if a.startswith("--world_info=")).split("=", 1)[1]
    assert json.loads(base64.urlsafe_b64decode(info)) == {"node1": [0, 1], "node2": [0, 1]}
    assert "--node_rank=1" in argv and "--master_addr=10.0.0.1" in argv


def test_lightning_and_command() -> None:
    p = plan(RunSpec(program="fit.py", launcher="lightning", run_id="r"))
    assert p.nodes[1].argv == ("/opt/py/bin/python", "fit.py") and p.nodes[1].pipe_rank == 2
    assert p.nodes[1].env["WORLD_SIZE"] == "4" and "LOCAL_RANK" not in p.nodes[1].env
    p = plan(RunSpec(program="nvidia-smi", args=("-L",), launcher="command", run_id="r"))
    assert p.nodes[1].argv == ("nvidia-smi", "-L") and p.nodes[1].nproc == 1
    assert p.nodes[1].env["RANK"] == "1" and p.nodes[1].env["WORLD_SIZE"] == "2"


LIGHTNING = """
import argparse
import lightning as L

parser = argparse.ArgumentParser()
parser.add_argument("--devices", type=int, default=1)
args = parser.parse_args()
trainer = L.Trainer(accelerator="cpu", devices={devices}, num_nodes={nodes}, strategy="ddp")
"""


def lightning_plan(tmp_path, devices: str, nodes: str = "3", c: Cluster | None = None, **spec_kw):
    (tmp_path / "fit.py").write_text(LIGHTNING.format(devices=devices, nodes=nodes))
    c = c or cluster(3)
    spec = RunSpec(program="fit.py", launcher="lightning", run_id="r", **spec_kw)
    return build_plan(c, spec, {h.name: NodeFacts(gpus=4) for h in c.hosts}, master_addr="10.0.0.1",
                      master_port=29400, head_env={}, head_cwd=str(tmp_path))


def test_lightning_processes_come_from_the_trainer_not_the_slots(tmp_path) -> None:
    """slots=2 and Trainer(devices=1) on 3 nodes is 3 processes: ranks 0, 1, 2."""
    p = lightning_plan(tmp_path, "1")
    assert p.world_size == 3 and [n.pipe_rank for n in p.nodes] == [0, 1, 2]
    assert {n.env["WORLD_SIZE"] for n in p.nodes} == {"3"}
    assert {n.env["CORRAL_NPROC_PER_NODE"] for n in p.nodes} == {"1"}  # the rank hook's LOCAL_RANK arithmetic
    assert lightning_plan(tmp_path, "args.devices", args=("--devices", "3")).world_size == 9
    assert lightning_plan(tmp_path, "args.devices").world_size == 3  # the option's default
    assert lightning_plan(tmp_path, "[0, 1]").world_size == 6
    assert lightning_plan(tmp_path, '"auto"').world_size == 3  # accelerator="cpu": one per node
    (tmp_path / "fit.py").write_text("import lightning as L\nL.Trainer(devices='auto', num_nodes=3)\n")
    c = cluster(3)
    p = build_plan(c, RunSpec(program="fit.py", launcher="lightning", run_id="r"),
                   {h.name: NodeFacts(gpus=4) for h in c.hosts}, master_addr="a", master_port=1,
                   head_env={}, head_cwd=str(tmp_path))
    assert p.world_size == 12  # auto: one per GPU
    # what corral cannot read: the hosts' slots, as before (run.py says so)
    assert lightning_plan(tmp_path, "n_devices").world_size == 6


def test_lightning_trainer_that_contradicts_the_run_is_refused(tmp_path) -> None:
    with pytest.raises(UsageError, match=r"fit.py:8 L.Trainer\(num_nodes=2\) but the cluster has 3 node"):
        lightning_plan(tmp_path, "1", nodes="2")
    with pytest.raises(UsageError, match=r"--nproc-per-node 2, but fit.py:8 L.Trainer\(devices=1\)"):
        lightning_plan(tmp_path, "1", nproc_per_node=2)
    assert lightning_plan(tmp_path, "2", nproc_per_node=2).world_size == 6


def test_nproc_resolution() -> None:
    c = cluster(slots=None)
    p = plan(RunSpec(program="t.py", run_id="r"), c, facts={"node1": NodeFacts(gpus=8), "node2": NodeFacts(gpus=8)})
    assert p.world_size == 16
    p = plan(RunSpec(program="t.py", nproc_per_node=3, run_id="r"), c)
    assert p.world_size == 6
    with pytest.raises(UsageError, match="same number of processes"):
        plan(RunSpec(program="t.py", run_id="r"), c, facts={"node1": NodeFacts(gpus=8), "node2": NodeFacts(gpus=4)})


def test_only_named_or_allowlisted_env_travels() -> None:
    head = {"NCCL_DEBUG": "INFO", "HOME": "/home/me", "AWS_SECRET_ACCESS_KEY": "s", "HF_TOKEN": "t",
            "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "0", "PATH": "/bin", "TORCH_NCCL_TRACE": "1",
            "TOKENIZERS_PARALLELISM": "false", "TORCH_HUB_TOKEN": "x", "NCCL_IB_KEY": "y"}
    # TOKENIZERS_PARALLELISM is on the documented list: a setting, not a token
    assert env_from_head(head) == {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "4", "TORCH_NCCL_TRACE": "1",
                                   "TOKENIZERS_PARALLELISM": "false"}
    # W&B's off switches travel as HF_HUB_OFFLINE does (`WANDB_MODE=offline corral run ...`); its key does not
    assert env_from_head({"WANDB_MODE": "offline", "WANDB_DISABLED": "true", "WANDB_API_KEY": "k"}) == {
        "WANDB_MODE": "offline", "WANDB_DISABLED": "true"}
    p = plan(RunSpec(program="t.py", env={"WANDB_API_KEY": "k"}, run_id="r"), head_env=head)
    env = p.nodes[0].env
    assert env["WANDB_API_KEY"] == "k" and "HOME" not in env and "HF_TOKEN" not in env


def test_allowlisted_prefixes_do_not_carry_secrets() -> None:
    head = {"NCCL_AUTH": "a", "TORCH_PRIVATEKEY": "k", "NCCL_AUTH_TOKEN": "t", "CUDA_PASSPHRASE": "p",
            "TORCH_HUB_APIKEY": "k", "PYTORCH_CREDS": "c", "KMP_SESSION_COOKIE": "c", "GLOO_PASSWD": "p",
            "NCCL_IB_PKEY": "1", "NCCL_DEBUG": "INFO", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
            "TOKENIZERS_PARALLELISM": "false", "NCCL_IB_HCA": "mlx5", "CUDA_LAUNCH_BLOCKING": "1"}
    assert env_from_head(head) == {
        "NCCL_IB_PKEY": "1", "NCCL_DEBUG": "INFO", "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "TOKENIZERS_PARALLELISM": "false", "NCCL_IB_HCA": "mlx5", "CUDA_LAUNCH_BLOCKING": "1"}


def test_cluster_and_host_env_layering() -> None:
    c = Cluster(hosts=(Host(name="a", slots=1, env={"NCCL_SOCKET_IFNAME": "ens1"}), Host(name="b", slots=1)),
                env={"NCCL_SOCKET_IFNAME": "eth0", "X": "1"})
    p = plan(RunSpec(program="t.py", env={"X": "2"}, run_id="r"), c, head_env={"NCCL_SOCKET_IFNAME": "lo"})
    assert p.nodes[0].env["NCCL_SOCKET_IFNAME"] == "ens1"
    assert p.nodes[1].env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert p.nodes[0].env["X"] == "2"


def test_env_flags() -> None:
    assert parse_env_flags(("A=1", "B"), {"B": "x"}) == {"A": "1", "B": "x"}
    with pytest.raises(UsageError, match="not set on this machine"):
        parse_env_flags(("C",), {})
    with pytest.raises(UsageError, match="not a valid variable name"):
        parse_env_flags(("1X=2",), {})
    with pytest.raises(UsageError, match="set by corral"):
        RunSpec(program="t.py", env={"MASTER_ADDR": "x"})
    with pytest.raises(UsageError, match="--launcher"):
        RunSpec(program="t.py", launcher="mpirun")


def test_a_node_whose_name_is_loopback_gets_gloos_interface_unless_the_job_sets_one() -> None:
    facts = {"node1": NodeFacts(), "node2": NodeFacts(gloo_ifname="eth0")}
    p = plan(RunSpec(program="train.py", run_id="r1"), facts=facts)
    assert "GLOO_SOCKET_IFNAME" not in p.nodes[0].env and p.nodes[1].env["GLOO_SOCKET_IFNAME"] == "eth0"
    mine = plan(RunSpec(program="train.py", run_id="r1", env={"GLOO_SOCKET_IFNAME": "ib0"}), facts=facts)
    assert mine.nodes[1].env["GLOO_SOCKET_IFNAME"] == "ib0"
    here = plan(RunSpec(program="train.py", run_id="r1"), facts=facts, head_env={"GLOO_SOCKET_IFNAME": "bond0"})
    assert here.nodes[1].env["GLOO_SOCKET_IFNAME"] == "bond0"


def test_torchrun_sets_omp_threads_only_where_the_job_does_not() -> None:
    """torchrun picks OMP_NUM_THREADS=1 itself for several processes per node,
    but prints a banner on every node saying so; corral sets the same value
    unless the job's environment has one (head, cluster file, --env)."""
    p = plan(RunSpec(program="train.py", run_id="r"))
    assert all(n.env["OMP_NUM_THREADS"] == "1" for n in p.nodes)
    p = plan(RunSpec(program="train.py", run_id="r"), head_env={"OMP_NUM_THREADS": "4"})
    assert all(n.env["OMP_NUM_THREADS"] == "4" for n in p.nodes)
    p = plan(RunSpec(program="train.py", run_id="r", env={"OMP_NUM_THREADS": "3"}))
    assert all(n.env["OMP_NUM_THREADS"] == "3" for n in p.nodes)
    one = plan(RunSpec(program="train.py", run_id="r"), cluster(slots=1))  # torchrun sets nothing
    assert all("OMP_NUM_THREADS" not in n.env for n in one.nodes)
    # accelerate starts its processes through torchrun's code: the same default
    acc = plan(RunSpec(program="train.py", run_id="r", launcher="accelerate"))
    assert all(n.env["OMP_NUM_THREADS"] == "1" for n in acc.nodes)


def test_gpus_run_one_process_per_gpu_of_the_subset_whatever_the_slots() -> None:
    p = plan(RunSpec(program="train.py", run_id="r", gpus=(4, 5)), cluster(slots=8))
    assert [n.nproc for n in p.nodes] == [2, 2] and p.world_size == 4
    assert {n.env["CUDA_VISIBLE_DEVICES"] for n in p.nodes} == {"4,5"}
    assert {n.env["CUDA_DEVICE_ORDER"] for n in p.nodes} == {"PCI_BUS_ID"}  # nvidia-smi's numbering
    assert "--nproc-per-node=2" in p.nodes[0].argv
    # per host, from the cluster file; --gpus wins over it
    c = Cluster(hosts=(Host(name="a", gpus=(0, 1, 2, 3)), Host(name="b", gpus=(4, 5, 6, 7))))
    p = plan(RunSpec(program="train.py", run_id="r"), c)
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in p.nodes] == ["0,1,2,3", "4,5,6,7"]
    assert [n.nproc for n in p.nodes] == [4, 4]
    p = plan(RunSpec(program="train.py", run_id="r", gpus=(7,)), c)
    assert [n.env["CUDA_VISIBLE_DEVICES"] for n in p.nodes] == ["7", "7"]


def test_gpus_and_a_cuda_visible_devices_of_the_jobs_own_are_refused() -> None:
    with pytest.raises(UsageError, match="--gpus and --env CUDA_VISIBLE_DEVICES"):
        RunSpec(program="train.py", gpus=(0,), env={"CUDA_VISIBLE_DEVICES": "1"})
