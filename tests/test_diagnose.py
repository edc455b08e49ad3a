"""Tests for corral.diagnose and `corral diagnose`.

Every rule is checked against the real error text it was written for
(tests/fixtures/diagnose/, each file's origin in the rule's ``source``), and
unrelated logs (a clean run, a user's KeyError, NCCL INFO chatter) against
false alarms.
"""

from __future__ import annotations

import codecs
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from corral.cli import cli
from corral.diagnose import (
    CATEGORIES,
    Matcher,
    RulesError,
    diagnose_path,
    diagnose_run,
    diagnose_text,
    load_facts,
    load_rules,
    prefilter,
)
from corral.diagnose.logtext import iter_text, parse, sniff_encoding
from corral.diagnose.pyexc import last_exception
from corral.diagnose.rules import tomllib  # tomli on Python 3.10

FIXTURES = Path(__file__).parent / "fixtures" / "diagnose"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "diagnose.md"
RULES = load_rules()
CASES = [(r.id, f) for r in RULES for f in r.fixtures]


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


# ---------------------------------------------------------------- knowledge base


def test_knowledge_base_is_large_and_covers_every_category():
    assert len(RULES) >= 30
    assert {r.category for r in RULES} == set(CATEGORIES)


@pytest.mark.parametrize("rule", RULES, ids=[r.id for r in RULES])
def test_every_rule_has_a_real_fixture_and_a_source(rule):
    assert rule.fixtures, f"{rule.id} has no fixture"
    assert rule.sources, f"{rule.id} does not say where its error text comes from"
    for name in rule.fixtures:
        assert (FIXTURES / name).is_file(), f"{rule.id}: missing fixture {name}"
    for src in rule.sources:
        assert src.startswith(("https://github.com/", "reproduced: ")), src


@pytest.mark.parametrize(("rule_id", "name"), CASES, ids=[f for _, f in CASES])
def test_fixture_is_diagnosed_with_its_rule_first(rule_id, name):
    diags = diagnose_path(FIXTURES / name)
    assert diags, f"{name}: nothing matched"
    assert diags[0].rule_id == rule_id, [(d.rule_id, d.confidence) for d in diags]
    assert diags[0].lines and diags[0].fix
    assert 0 < diags[0].confidence < 1


def test_every_fixture_file_belongs_to_a_rule_or_is_negative():
    used = {f for r in RULES for f in r.fixtures}
    for path in FIXTURES.glob("*.log"):
        assert path.name in used or path.name.startswith("negative-"), path.name


# Every negative-*.log (healthy output of real runs, or unrelated errors) must stay silent.
@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("negative-*.log")))
def test_unrelated_logs_are_not_diagnosed(name):
    # a notice (NCCL fell back to sockets) is worth naming in a healthy log, and is no failure
    assert [d for d in diagnose_path(FIXTURES / name) if not d.notice] == []


def test_nccl_info_chatter_is_not_an_nccl_problem():
    diags = diagnose_path(FIXTURES / "negative-nccl-info.log")
    assert [d for d in diags if d.category == "network" and not d.notice] == []


def test_same_op_everywhere_is_a_timeout_not_a_collective_mismatch():
    ids = [d.rule_id for d in diagnose_path(FIXTURES / "collective-timeout.log")]
    assert ids == ["collective-timeout"]
    assert "collective-mismatch" in [d.rule_id for d in diagnose_path(FIXTURES / "collective-mismatch.log")]


def test_other_processes_with_a_small_share_do_not_make_it_a_shared_gpu():
    """Three 474 MiB CUDA contexts next to a process holding 60 GiB of a 63 GiB GPU: a plain OOM."""
    ids = [d.rule_id for d in diagnose_path(FIXTURES / "cuda-oom.3.log")]
    assert ids == ["cuda-oom"]
    # the same report where the others hold most of the GPU is a shared GPU
    ids = [d.rule_id for d in diagnose_path(FIXTURES / "cuda-oom-shared-gpu.log")]
    assert ids == ["cuda-oom-shared-gpu", "cuda-oom"]


def test_one_other_process_holding_the_gpu_is_enough():
    line = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
            "capacity of 79.15 GiB of which 1.10 GiB is free. Process 4242 has 40.00 GiB memory in use. "
            "Including non-PyTorch memory, this process has 38.00 GiB memory in use.")
    assert diagnose_text(line)[0].rule_id == "cuda-oom-shared-gpu"
    small = line.replace("40.00 GiB memory in use. Including", "300.00 MiB memory in use. Including")
    assert [d.rule_id for d in diagnose_text(small)] == ["cuda-oom"]


def test_store_barrier_with_more_workers_than_world_size_is_not_missing_ranks():
    extra = [d.rule_id for d in diagnose_path(FIXTURES / "store-extra-clients.log")]
    assert extra[0] == "store-extra-clients" and "store-waiting-for-clients" not in extra
    missing = [d.rule_id for d in diagnose_path(FIXTURES / "store-waiting-for-clients.2.log")]
    assert missing == ["store-waiting-for-clients"]


def test_nccl_shared_memory_failure_outranks_the_system_error_it_causes():
    diags = diagnose_text(fixture("shm-too-small.4.log") + "RuntimeError: NCCL Error 2: unhandled system error\n")
    assert [d.rule_id for d in diags] == ["shm-too-small", "nccl-system-error"]
    assert any("NCCL_SHM_DISABLE=1" in step for step in diags[0].fix)


def test_detail_shape_mismatch_is_not_told_to_rerun_with_detail():
    diags = diagnose_path(FIXTURES / "collective-shape-mismatch.log")
    assert [d.rule_id for d in diags] == ["collective-shape-mismatch"]
    assert not any("TORCH_DISTRIBUTED_DEBUG" in step for step in diags[0].fix)
    assert diags[0].fix[0] == ("In ALLREDUCE, rank 1 had a tensor of shape [195812480] and rank 0 one of "
                               "shape [51123456].")
    # a mismatch seen by the watchdog: the DETAIL rerun comes after the fixes
    top = diagnose_path(FIXTURES / "collective-mismatch.log")[0]
    assert top.fix[-1].startswith("To see the call each rank is in, rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL")
    assert top.fix[0].startswith("Give every rank the same number of batches")


def test_rendezvous_store_that_closed_is_not_an_unreachable_address():
    diags = diagnose_path(FIXTURES / "rendezvous-store-closed.log")
    assert diags[0].rule_id == "rendezvous-store-closed"
    assert "store-unreachable" not in [d.rule_id for d in diags]


@pytest.mark.parametrize(
    ("text", "step"),
    [
        ("old_launch.py: error: the following arguments are required: --local_rank/--local-rank",
         "The script requires --local_rank/--local-rank on its command line, but its launcher passed none"),
        ("main.py: error: the following arguments are required: --config, --local_rank",
         "The script requires --local_rank on its command line"),
        ("train.py: error: unrecognized arguments: --local-rank=0",
         "The launcher passed --local-rank=N and the script's parser does not accept that spelling"),
        ("train.py: error: unrecognized arguments: --fp16 --local_rank=3",
         "The launcher passed --local_rank=N"),
    ],
)
def test_local_rank_argument_says_which_way_round(text, step):
    (top,) = diagnose_text(text)
    assert top.rule_id == "local-rank-argument"
    assert top.fix[0].startswith(step)
    assert any("os.environ['LOCAL_RANK']" in f for f in top.fix)
    assert any("--launcher deepspeed" in f for f in top.fix)


def test_missing_module_may_be_the_projects_own_file():
    # pytorch/examples' minGPT-ddp main.py imports its model.py from beside it
    (top,) = diagnose_text("  File \"/srv/proj/mingpt/main.py\", line 6, in <module>\n"
                           "    from model import GPT, GPTConfig\n"
                           "ModuleNotFoundError: No module named 'model'\n")
    assert top.rule_id == "module-not-found"
    assert top.fix[0] == "Check on every node, with the launcher's interpreter: `python -c 'import model'`."
    assert top.fix[1].startswith("If `model` is your own code (a `model.py` file or `model/` package next to the script)")
    assert "corral run --sync" in top.fix[1]


def test_sigkill_names_the_host_to_check_once():
    # `corral run` showed "Check node2: dmesg ..." and then "Confirm on that node: dmesg ..."
    (top,) = diagnose_text("Signal 9 (SIGKILL) received by PID 4242", host="node2")
    assert top.rule_id == "host-oom-killed"
    assert top.fix[0] == ("Confirm on node2: `dmesg -T | grep -i -E 'killed process|out of memory'` "
                          "or `journalctl -k`.")
    assert sum("dmesg" in step for step in top.fix) == 1
    (anywhere,) = diagnose_text("Signal 9 (SIGKILL) received by PID 4242")
    assert anywhere.fix[0].startswith("Confirm on that node: `dmesg")
    assert sum("dmesg" in step for step in anywhere.fix) == 1


def test_other_argparse_errors_are_not_a_local_rank_problem():
    assert diagnose_text("train.py: error: the following arguments are required: --config\n"
                         "train.py: error: unrecognized arguments: --local-batch=4\n") == []


def test_a_1d_embedding_weight_outside_deepspeed_is_not_a_zero3_problem():
    # F.embedding on a 1-D weight in plain single-process code (newlei/FDA#1) ...
    plain = ('    return torch.embedding(weight, input, padding_idx, scale_grad_by_freq, sparse)\n'
             "RuntimeError: 'weight' must be 2-D\n")
    assert diagnose_text(plain) == []
    # ... and the same error next to ZeRO-3's empty placeholder parameter is one
    assert diagnose_text(plain + "Parameter containing:\ntensor([], device='cuda:1', dtype=torch.float16)\n"
                         )[0].rule_id == "zero3-partitioned-param"


def test_srun_step_retries_that_end_in_a_step_are_not_a_failure():
    waited = "srun: Job 23547409 step creation temporarily disabled, retrying (Requested nodes are busy)\n"
    assert diagnose_text(waited)[0].rule_id == "slurm-step-creation-blocked"
    assert diagnose_text(waited + "srun: Step created for StepId=23547409.1\n") == []


def test_ray_memory_monitor_reporting_no_oom_kills_is_not_an_oom():
    line = ("(raylet) node_manager.cc:3084: 0 Workers (tasks / actors) killed due to memory pressure (OOM), "
            "4 Workers crashed due to other reasons at node (ID: b287, IP: 172.28.0.12)")
    assert "ray-worker-died" not in [d.rule_id for d in diagnose_text(line)]
    assert diagnose_text(line.replace(": 0 Workers", ": 4 Workers"))[0].rule_id == "ray-worker-died"


def test_nccl_without_cuda_says_to_fall_back_to_gloo():
    top = diagnose_path(FIXTURES / "nccl-backend-unavailable.2.log")[0]
    assert top.rule_id == "nccl-backend-unavailable"
    assert "backend='nccl' if torch.cuda.is_available() else 'gloo'" in top.fix[0]
    # the existing rule for a collective before init_process_group stays separate
    assert diagnose_text("RuntimeError: Default process group has not been initialized, please make "
                         "sure to call init_process_group.")[0].rule_id == "process-group-not-initialized"


@pytest.mark.parametrize(
    ("text", "rule_id"),
    [
        # the third held-out round's classes, in the other wordings they come in
        ("RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable", "cuda-device-busy"),
        ("RuntimeError: cuda runtime error (802) : system not yet initialized at THCGeneral.cpp:50",
         "gpu-fabric-manager"),
        ("AssertionError: no_sync context manager is incompatible with gradient partitioning logic of "
         "ZeRO stage 2", "zero-no-sync"),
        ("RuntimeError: No backend type associated with device type cpu", "collective-on-cpu-tensor"),
        ("ValueError: Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`",
         "fsdp-mixed-requires-grad"),
        ("[rank0]: RuntimeError: aten.cat.default: got mixed torch.Tensor and DTensor, need to convert all "
         "torch.Tensor to DTensor before calling distributed operators!", "dtensor-mixed"),
        ("Parameter at index 753 has been marked as ready twice. This means that multiple autograd engine "
         " hooks have fired for this particular parameter during this iteration.", "ddp-reentrant-checkpoint"),
        ("AssertionError: CUDA_HOME does not exist, unable to compile CUDA op(s)", "deepspeed-cuda-home-missing"),
        ('docker: Error response from daemon: could not select device driver "" with capabilities: [[gpu]].',
         "container-gpu-runtime"),
        ("RuntimeError: Missing key in checkpoint state_dict: model.2.weight", "dcp-key-mismatch"),
        ("OSError: Unable to open file (unable to lock file, errno = 35, error message = 'Resource "
         "temporarily unavailable')", "hdf5-file-lock"),
    ],
)
def test_new_classes_read_their_other_wordings(text, rule_id):
    assert diagnose_text(text)[0].rule_id == rule_id


def test_container_runtime_error_is_found_after_its_cli_prefix():
    # "nvidia-container-cli:" looks like a pdsh host prefix to the log reader
    (top,) = diagnose_path(FIXTURES / "container-gpu-runtime.log")
    assert top.rule_id == "container-gpu-runtime"
    assert any("nvidia-ctk runtime configure --runtime=docker" in step for step in top.fix)


def test_ddp_warnings_of_healthy_runs_are_not_failures():
    assert diagnose_text(
        "[W reducer.cpp:1303] Warning: find_unused_parameters=True was specified in DDP constructor, but did "
        "not find any unused parameters in the forward pass. This flag results in an extra traversal of the "
        "autograd graph every iteration,  which can adversely affect performance.\n"
        "UserWarning: torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly.\n"
    ) == []


def test_nccl_connect_retries_count_only_when_nccl_gives_up():
    # NCCL 2.24+ logs every connect retry at INFO; only the last, "(34/34)", is a failure
    lines = fixture("nccl-connect-refused.7.log").splitlines()
    assert "nccl-connect-refused" not in [d.rule_id for d in diagnose_text("\n".join(lines[:-1]))]
    assert diagnose_text("\n".join(lines))[0].rule_id == "nccl-connect-refused"


def test_cuda_operation_not_supported_in_nccl_setup_points_at_the_driver():
    top = diagnose_path(FIXTURES / "nccl-unhandled-cuda-error.3.log")[0]
    assert top.rule_id == "nccl-unhandled-cuda-error"
    assert any("'operation not supported'" in step and "driver" in step for step in top.fix)


def test_srun_giving_up_after_step_retries_is_the_blocked_step_not_a_rejection():
    gave_up = "srun: error: Unable to create step for job 29986033: Memory required by task is not available\n"
    # alone, Slurm refused the step as asked
    assert diagnose_text(gave_up)[0].rule_id == "slurm-request-rejected"
    # after "step creation temporarily disabled" retries, another step held the memory
    waited = "srun: Job 29986033 step creation temporarily disabled, retrying (Requested nodes are busy)\n"
    assert diagnose_text(waited + gave_up)[0].rule_id == "slurm-step-creation-blocked"


def test_nccl_cuda_failure_asks_for_nccl_debug_only_when_the_log_does_not_name_the_error():
    bare = diagnose_text("RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1269, "
                         "unhandled cuda error, NCCL version 2.14.3")[0]
    assert bare.rule_id == "nccl-unhandled-cuda-error"
    assert "NCCL_DEBUG=WARN" in bare.fix[0]
    for name in ("nccl-unhandled-cuda-error.2.log", "nccl-unhandled-cuda-error.3.log"):
        top = diagnose_path(FIXTURES / name)[0]
        assert top.rule_id == "nccl-unhandled-cuda-error"
        assert not any("NCCL_DEBUG" in step for step in top.fix), name


@pytest.mark.parametrize(
    ("text", "rule_id"),
    [
        # the eighth held-out round's classes, in the other wordings they come in (real lines)
        ("[2021-04-18 06:54:54,934 C 756 756] service_based_gcs_client.cc:229: Couldn't reconnect to GCS server. "
         "The last attempted GCS server address was 10.42.0.44:43507", "ray-gcs-unreachable"),
        ("Exiting because this node manager has mistakenly been marked as dead by the GCS", "ray-node-dead"),
        ("[rank2]: OSError: [Errno 39] Directory not empty: '/root/results/tmp-checkpoint-s0yubqtr' -> "
         "'/root/results/checkpoint-50'", "shared-fs-write-race"),
        ("FileExistsError: [Errno 17] File exists: '/path/to/run_dir/log/validation'", "shared-fs-write-race"),
        ("AssertionError: num_heads (52) must be divisible by mp_size (8)", "parallel-size-mismatch"),
        ("paramiko.ssh_exception.SSHException: not a valid OPENSSH private key file", "ssh-permission-denied"),
    ],
)
def test_round_eight_classes_read_their_other_wordings(text, rule_id):
    assert diagnose_text(text)[0].rule_id == rule_id


def test_empty_ray_head_address_is_named():
    top = diagnose_path(FIXTURES / "ray-gcs-unreachable.log")[0]
    assert top.rule_id == "ray-gcs-unreachable"
    assert "no host part (':6379')" in top.fix[0]


def test_docs_list_every_rule():
    text = DOCS.read_text(encoding="utf-8")
    missing = [r.id for r in RULES if f"`{r.id}`" not in text]
    assert not missing, f"docs/diagnose.md does not list: {missing}"


# ------------------------------------------------------------------ validation

_GOOD = """
[[rule]]
id = "my-rule"
title = "t"
category = "network"
patterns = ['boom']
cause = "c"
fix = ["f"]
"""


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.replace('fix = ["f"]', 'fix = ["f"]\ncolour = "red"'), "unknown key(s): colour"),
        (lambda s: s.replace("['boom']", "['(unclosed']"), "does not compile"),
        (lambda s: s.replace('cause = "c"\n', ""), "missing required key 'cause'"),
        (lambda s: s.replace('"network"', '"plumbing"'), "unknown category 'plumbing'"),
        (lambda s: s + '[[rule.refine]]\nwhen = "moon_phase"\nfix = "x"\n', "unknown predicate"),
        (lambda s: s + '[[rule.refine]]\nfix = "use {nothing}"\n', "'{nothing}'"),
        (lambda s: s + _GOOD, "defined twice"),
        (lambda s: s.replace('fix = ["f"]', 'fix = ["f"]\ndistinct = "op"'), "no pattern captures"),
        (lambda s: s.replace("['boom']", "[]"), "at least one regex"),
        (lambda s: s.replace("['boom']", "[{ re = 'boom', check = 'moon_phase' }]"),
         "pattern check 'moon_phase' is unknown"),
        (lambda s: s.replace("['boom']", "[{ re = 'boom (?P<joined>\\d+)', check = 'joined_above_expected' }]"),
         "reads group(s) expected"),
        (lambda s: s + '[[rule.refine]]\nfix = "x"\nlast = "yes"\n', "must be true or false"),
        (lambda s: s.replace('fix = ["f"]', 'fix = ["f"]\nsymptom = "yes"'), "'symptom' must be true or false"),
    ],
)
def test_bad_rules_are_rejected_naming_the_entry(tmp_path, edit, message):
    path = tmp_path / "rules.toml"
    path.write_text(edit(_GOOD))
    with pytest.raises(RulesError) as info:
        load_rules([path])
    assert message in info.value.message
    assert "my-rule" in info.value.message or "rule #" in info.value.message
    assert str(path) in info.value.message


def test_extra_rules_file_adds_a_rule(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(_GOOD.replace("'boom'", "'flux capacitor overheated'"))
    rules = load_rules([path])
    assert rules[-1].id == "my-rule"
    diags = diagnose_text("x\nERROR flux capacitor overheated\n", rules=rules)
    assert [d.rule_id for d in diags] == ["my-rule"]


# ------------------------------------------------------------------ log lines


@pytest.mark.parametrize(
    ("raw", "host", "rank", "text"),
    [
        ("[rank3]: RuntimeError: x", None, 3, "RuntimeError: x"),
        ("[node2/r3] hello", "node2", 3, "hello"),
        ("node2/r3 | hello", "node2", 3, "hello"),
        ("[r5] hello", None, 5, "hello"),
        ("[node2] torchrun says", "node2", None, "torchrun says"),
        ("node7: ssh: Could not resolve hostname", "node7", None, "ssh: Could not resolve hostname"),
        ("pdsh@head: gpu-03: ssh exited with exit code 255", "gpu-03", None,
         "ssh exited with exit code 255"),
        ("[1,2]<stdout>:x", None, 2, "x"),
        ("[alphagpu12:5]:[rank5]:[E213] boom", "alphagpu12", 5, "[E213] boom"),
        ("10: torch.distributed.DistBackendError: NCCL", None, None,
         "torch.distributed.DistBackendError: NCCL"),
        ("(RayWorkerVllm pid=7602) ERROR x", None, None, "ERROR x"),
        ("RuntimeError: CUDA error", None, None, "RuntimeError: CUDA error"),
        ("torch.distributed.DistBackendError: NCCL error", None, None,
         "torch.distributed.DistBackendError: NCCL error"),
        ("kolyoz2:25146:25854 [0] NCCL WARN NET/IB", "kolyoz2", None,
         "kolyoz2:25146:25854 [0] NCCL WARN NET/IB"),
        ("\x1b[31m[rank1]:\x1b[0m boom", None, 1, "boom"),
        # bracketed numbers are a pid or a kernel timestamp, never a host; an IPv4 address is one
        ("[80746] [rank0]:[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog", None, 0,
         "[E321 02:07:08.408271257 ProcessGroupNCCL.cpp:607] [Rank 0] Watchdog"),
        ("[2059991.491436] oom-kill:constraint=CONSTRAINT_NONE", None, None, "oom-kill:constraint=CONSTRAINT_NONE"),
        ("[  12.5] Out of memory: Killed process 25315", None, None, "Out of memory: Killed process 25315"),
        ("[10.0.0.3] torchrun says", "10.0.0.3", None, "torchrun says"),
        ("[2026-03-13 22:26:02] node-01:1234:1240 [5] NCCL WARN x", "node-01", None,
         "node-01:1234:1240 [5] NCCL WARN x"),
        ("[trainer0|0]:ncclInternalError: Internal check failed.", None, None,
         "ncclInternalError: Internal check failed."),
        ("(pid=909608) z-pc:909608:910337 [0] NCCL WARN x", "z-pc", None, "z-pc:909608:910337 [0] NCCL WARN x"),
        # the rank in torch's own log header (old format, default group) ...
        ("[E ProcessGroupNCCL.cpp:737] [Rank 3] Watchdog caught", None, 3,
         "[E ProcessGroupNCCL.cpp:737] [Rank 3] Watchdog caught"),
        # ... but not a rank within another process group
        ("[E321 02:07:08.465 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 0] Exception", None, None,
         "[E321 02:07:08.465 ProcessGroupNCCL.cpp:1664] [PG 1 Rank 0] Exception"),
        ("srun: error: gpu-0-1: tasks 8-13,15: Exited with exit code 1", "gpu-0-1", None,
         "srun: error: gpu-0-1: tasks 8-13,15: Exited with exit code 1"),
        # a tool naming itself is not a pdsh host; a dashed host name still is
        ("nvidia-container-cli: initialization error: load library failed", None, None,
         "nvidia-container-cli: initialization error: load library failed"),
        ("ssh-keygen: generating new host keys", None, None, "ssh-keygen: generating new host keys"),
        ("gpu-node-a: RuntimeError: boom", "gpu-node-a", None, "RuntimeError: boom"),
        # NeMo-Run: "<job>/<task> [default1]:[rank1]:"; the job name is not a host
        ("B-nemo-ft3/0 [default1]:[rank1]: RuntimeError: boom", None, 1, "RuntimeError: boom"),
        ("nemo.collections.llm.api.pretrain/0 [default0]:[rank0]: RuntimeError: world_size (1) is not divisible by 2",
         None, 0, "RuntimeError: world_size (1) is not divisible by 2"),
    ],
)
def test_launcher_prefixes_are_stripped_and_attributed(raw, host, rank, text):
    (line,) = parse(raw, 1)
    assert (line.host, line.rank, line.text) == (host, rank, text)


def test_torchelastic_role_prefix_gives_the_local_rank():
    (line,) = parse("[trainer3]:twshared1016:1958:1958 [3] NCCL INFO x", 1)
    assert (line.local_rank, line.host) == (3, "twshared1016")
    (line,) = parse("[trainer0|2]:ncclInternalError", 1)
    assert (line.local_rank, line.host, line.text) == (0, None, "ncclInternalError")


def test_a_number_in_brackets_is_never_reported_as_the_host():
    text = "[2059991.491436] oom-kill:constraint=CONSTRAINT_NONE,task=python3,pid=25315\n" \
        "[2059991.491542] Out of memory: Killed process 25315 (python3) total-vm:53312244kB\n"
    (top,) = diagnose_text(text)
    assert (top.rule_id, top.host, top.hosts) == ("host-oom-killed", None, ())
    assert not any("2059991" in step for step in top.fix)


def test_where_names_only_the_lines_that_show_the_failure():
    """A context line from another process does not make its host a place the failure was seen."""
    top = diagnose_path(FIXTURES / "nccl-no-socket-interface.log")[0]
    assert top.rule_id == "nccl-no-socket-interface"
    assert any("twshared1016" in m.text for m in top.lines)  # the context line is still evidence
    assert (top.host, top.hosts) == (None, ())
    assert "also seen on" not in _invoke(str(FIXTURES / "nccl-no-socket-interface.log")).output


def test_every_rank_that_shows_the_failure_is_listed():
    top = diagnose_text("\n".join(
        f"[E ProcessGroupNCCL.cpp:737] [Rank {r}] Watchdog caught collective operation timeout: "
        f"WorkNCCL(SeqNum=469508, OpType=ALLREDUCE, Timeout(ms)=1800000) ran for 1802212 milliseconds "
        f"before timing out." for r in (1, 3, 2, 6, 7)))[0]
    assert (top.rule_id, top.rank, top.ranks) == ("collective-timeout", 1, (1, 2, 3, 6, 7))


def test_srun_names_the_host_of_the_failed_tasks():
    top = diagnose_path(FIXTURES / "srun-task-failed.log")[0]
    assert (top.rule_id, top.host) == ("srun-task-failed", "slurm-job-compute-0-0")
    assert top.hosts == ("slurm-job-compute-0-0", "slurm-job-compute-0-1")
    assert top.fix[0].startswith("srun names slurm-job-compute-0-0: task(s) 2-7 exited with code 1")


_FIRST_LINE = "[rank1]: RuntimeError: Default process group has not been initialized\nstep 2\n"


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-8-sig", "utf-32"])
def test_logs_written_with_a_byte_order_mark_are_decoded(tmp_path, encoding):
    """Windows PowerShell's `>` writes UTF-16 with a BOM; the BOM must not hide line 1's prefix."""
    data = _FIRST_LINE.encode(encoding)
    if encoding == "utf-16-be":
        data = codecs.BOM_UTF16_BE + data
    (tmp_path / "ps.log").write_bytes(data)
    (top,) = diagnose_path(tmp_path / "ps.log")
    assert (top.rule_id, top.rank, top.lines[0].line) == ("process-group-not-initialized", 1, 1)
    assert top.lines[0].text == _FIRST_LINE.splitlines()[0]


def test_utf16_without_a_byte_order_mark_is_recognised(tmp_path):
    path = tmp_path / "nobom.log"
    path.write_bytes(fixture("nccl-duplicate-gpu.log").encode("utf-16-le"))
    assert diagnose_path(path)[0].rule_id == "nccl-duplicate-gpu"
    assert sniff_encoding(b"plain ascii log text, line one\n") == "utf-8"
    assert sniff_encoding("héllo wörld, a UTF-8 log\n".encode()) == "utf-8"
    assert sniff_encoding("plain ascii log text\n".encode("utf-16-be")) == "utf-16-be"


def test_text_with_a_byte_order_mark_is_diagnosed():
    (top,) = diagnose_text("\ufeff" + _FIRST_LINE)
    assert (top.rule_id, top.rank) == ("process-group-not-initialized", 1)


def test_carriage_return_segments_are_separate_lines():
    lines = parse("train: 10%|#   | 1/10\rtrain: 20%|##  | 2/10\rRuntimeError: boom", 7)
    assert [ln.text for ln in lines][-1] == "RuntimeError: boom"
    assert {ln.number for ln in lines} == {7}


def test_huge_log_streams_with_bounded_lines(tmp_path):
    path = tmp_path / "big.log"
    with path.open("w") as f:
        for i in range(60_000):
            f.write(f"step {i} loss 0.{i % 97:02d}\n")
        f.write("x" * 2_000_000 + "\n")  # one runaway line (a progress bar without newlines)
        f.write(fixture("nccl-system-error.log"))
    diags = diagnose_path(path)
    assert diags[0].rule_id == "nccl-system-error"
    assert diags[0].lines[0].line > 60_000
    assert all(len(m.text) <= 8192 for m in diags[0].lines)


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.log")))
def test_block_scanning_finds_what_line_by_line_matching_finds(monkeypatch, name):
    """The fast path (literals found in big blocks) must not lose or misnumber a line."""
    slow = Matcher().feed_all(iter_text(fixture(name))).diagnoses()
    monkeypatch.setattr(prefilter, "CHUNK", 97)  # many block boundaries inside lines
    with (FIXTURES / name).open() as stream:
        fast = Matcher().feed_stream(stream).diagnoses()
    assert [(d.rule_id, [m.line for m in d.lines]) for d in fast] == \
        [(d.rule_id, [m.line for m in d.lines]) for d in slow]


def test_every_builtin_pattern_has_a_literal_for_the_fast_path():
    regexes = [rx for r in RULES for rx in [p.regex for p in r.patterns] + [*r.requires, *r.excludes]]
    assert prefilter.literal_set(regexes) is not None
    assert prefilter.literals(re.compile(r"(?:Process \d+ has [\d.]+ GiB memory in use\. ){2,}")) == \
        [" GiB memory in use. "]
    assert prefilter.literals(re.compile(r"\d+\s+")) is None


def test_coloured_log_keeps_line_numbers():
    text = "\x1b[32mstep 1\x1b[0m\nok\n\x1b[1;31m[rank1]: RuntimeError: Default process group has " \
        "not been initialized\x1b[0m\n"
    (top,) = diagnose_text(text)
    assert (top.rule_id, top.lines[0].line, top.rank) == ("process-group-not-initialized", 3, 1)


def test_live_feed_attributes_lines_to_their_host_and_rank():
    m = Matcher()
    m.feed_text("starting", host="node3", rank=5)
    for raw in fixture("gloo-socket-ifname-missing.log").splitlines():
        m.feed_text(raw, host="node3", rank=5)
    top = m.diagnoses()[0]
    assert (top.rule_id, top.host, top.rank) == ("gloo-socket-ifname-missing", "node3", 5)
    assert "node3" in top.fix[0] and "nosuch" in top.fix[0]


# ------------------------------------------------------------------ facts


def _facts(host: str, *, ib: list, env: dict | None = None) -> dict:
    return {
        "host": host,
        "interfaces": [
            {"name": "lo", "addresses": ["127.0.0.1/8"], "state": "unknown", "kind": "loopback"},
            {"name": "docker0", "addresses": ["172.17.0.1/16"], "state": "up", "kind": "docker"},
            {"name": "eth0", "addresses": ["10.0.0.3/24"], "state": "up", "kind": "ethernet"},
        ],
        "infiniband": ib,
        "env": env or {},
        "packages": {"torch": "2.4.0"},
    }


_IB = [{"device": "mlx5_0", "port": 1, "state": "ACTIVE", "rate": "200 Gb/sec (4X HDR)",
        "link_layer": "InfiniBand"}]


def test_nccl_system_error_on_a_node_without_infiniband_names_that_node():
    facts = {"node1": _facts("node1", ib=_IB), "node2": _facts("node2", ib=[])}
    top = diagnose_text(fixture("nccl-system-error.log"), facts=facts)[0]
    assert top.rule_id == "nccl-system-error"
    assert "node2" in top.fix[0] and "NCCL_IB_DISABLE=1" in top.fix[0]
    assert not any("node1" in step for step in top.fix)


def test_unknown_infiniband_is_not_evidence():
    facts = {"node2": {**_facts("node2", ib=[]), "infiniband": None}}
    top = diagnose_text(fixture("nccl-system-error.log"), facts=facts, host="node2")[0]
    assert not any("node2 has no InfiniBand" in step for step in top.fix)


def test_wrong_nccl_socket_ifname_lists_the_interfaces_the_node_has():
    facts = {"node2": _facts("node2", ib=_IB, env={"NCCL_SOCKET_IFNAME": "ens5"})}
    top = diagnose_text(fixture("nccl-system-error.log"), facts=facts, host="node2")[0]
    step = next(s for s in top.fix if "NCCL_SOCKET_IFNAME=ens5" in s)
    assert "eth0 (10.0.0.3/24, up)" in step and "NCCL_SOCKET_IFNAME=eth0 for node2" in step


def test_virtual_interfaces_are_pointed_out_only_when_a_real_one_exists():
    hf = _facts("node2", ib=_IB)
    hf["interfaces"].append({"name": "br-lab", "addresses": ["192.168.9.1/24"], "state": "up",
                             "kind": "bridge"})
    top = diagnose_text(fixture("nccl-system-error.log"), facts={"node2": hf}, host="node2")[0]
    assert any("virtual interfaces (br-lab)" in s and "NCCL_SOCKET_IFNAME=eth0" in s for s in top.fix)
    hf["interfaces"] = [i for i in hf["interfaces"] if i["name"] != "eth0"]
    top = diagnose_text(fixture("nccl-system-error.log"), facts={"node2": hf}, host="node2")[0]
    assert not any("virtual interfaces" in s for s in top.fix)


def test_versions_differ_across_nodes_are_listed():
    facts = {"node1": _facts("node1", ib=[]), "node2": _facts("node2", ib=[])}
    facts["node2"]["packages"] = {"torch": "2.3.1"}
    top = diagnose_text(fixture("nccl-version-mismatch.log"), facts=facts)[0]
    assert any("torch: node1 2.4.0, node2 2.3.1" in s for s in top.fix)


# ------------------------------------------------------------------ run directories


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "20260101-000000-abcd"
    (run / "node1").mkdir(parents=True)
    (run / "node2").mkdir()
    (run / "run.json").write_text(json.dumps({
        "run_id": run.name, "status": "failed", "exit_code": 1, "hosts": [],
        "failure": {"host": "node2", "rank": 3, "exit_code": 1, "signal": None},
    }))
    (run / "node1" / "rank0.log").write_text(fixture("peer-process-exited.log"))
    (run / "node1" / "rank1.log").write_text(fixture("negative-clean-run.log"))
    (run / "node2" / "rank2.log").write_text(fixture("gloo-socket-ifname-missing.log"))
    (run / "node2" / "rank3.log").write_text(fixture("gloo-socket-ifname-missing.log"))
    (run / "node2" / "launcher.log").write_text("W1123 Sending process 5046 closing signal SIGTERM\n")
    facts = {"node2": _facts("node2", ib=[], env={"GLOO_SOCKET_IFNAME": "nosuch"})}
    (run / "facts.json").write_text(json.dumps(facts))
    return run


def test_run_dir_attributes_causes_to_host_and_rank(tmp_path):
    report = diagnose_run(_run_dir(tmp_path))
    assert report.kind == "run" and report.failure.host == "node2" and report.failure.rank == 3
    first, *rest = report.diagnoses
    assert (first.rule_id, first.host, first.rank) == ("gloo-socket-ifname-missing", "node2", 3)
    assert first.ranks == (2, 3)
    assert first.lines[0].origin == "node2/rank3.log"
    # facts.json makes the fix exact: the node, its interfaces, the one to use
    assert "On node2, GLOO_SOCKET_IFNAME=nosuch" in first.fix[0]
    assert "GLOO_SOCKET_IFNAME=eth0 for node2" in first.fix[0]
    echo = next(d for d in rest if d.rule_id == "peer-process-exited")
    assert echo.host == "node1" and echo.rank == 0
    # the echo on another rank is a consequence of the first failure, listed after the causes
    assert echo.symptom and echo.consequence and not first.consequence
    assert report.diagnoses[-1] is echo


def test_real_sandbox_run_names_the_node_with_the_bad_interface():
    """A 2-node sandbox run where only dgx2 had GLOO_SOCKET_IFNAME=ens5 (recorded as is)."""
    run = FIXTURES / "run-sandbox-gloo-ifname"
    top = diagnose_path(run)[0]
    assert (top.rule_id, top.host, top.rank, top.hosts) == \
        ("gloo-socket-ifname-missing", "dgx2", 2, ("dgx2",))
    assert top.fix[0].startswith("dgx2 has no usable interface named 'ens5'")
    # with the facts `corral doctor --json` collected from the same sandbox:
    facts = load_facts(FIXTURES / "doctor-sandbox.json")
    assert sorted(facts) == ["dgx1", "dgx2"]
    top = diagnose_path(run, facts=facts)[0]
    assert "On dgx2, GLOO_SOCKET_IFNAME=ens5 matches no interface" in top.fix[0]
    assert "Set GLOO_SOCKET_IFNAME=eth0 for dgx2." in top.fix[0]


def test_first_failing_rank_comes_first_even_with_lower_confidence(tmp_path):
    run = _run_dir(tmp_path)
    shutil.rmtree(run / "node2")
    (run / "node2").mkdir()
    (run / "node2" / "rank3.log").write_text(fixture("host-oom-killed.log"))  # 0.7
    (run / "node1" / "rank1.log").write_text(fixture("nccl-system-error.log"))  # 0.9
    ids = [d.rule_id for d in diagnose_path(run)]
    assert ids[:2] == ["host-oom-killed", "nccl-system-error"]


# A real 3-node run (corral run, torchrun launcher, gloo): rank 3 raised a
# KeyError in the user's code, the others lost their peer.
KEYERROR_RUN = FIXTURES / "run-keyerror-rank3"
# A real 3-node run with --hang-timeout: rank 4 stuck reading a shard, the rest in all_reduce.
HANG_RUN = FIXTURES / "run-hang-rank4"
# A real 3-node run with --hang-timeout: every rank in init_process_group with
# init_method="file:///tmp/ddp_example", a different file on each node.
HANG_INIT_RUN = FIXTURES / "run-hang-init-filestore"


def test_first_failing_ranks_own_exception_comes_first():
    report = diagnose_run(KEYERROR_RUN)
    fe = report.first_error
    assert fe.summary == "rank 3 on h1n2 failed first: KeyError: 'batch_size' (crash_rank3.py:9)"
    assert (fe.type, fe.message, fe.func, fe.line) == ("KeyError", "'batch_size'", "load_batch", 9)
    assert (fe.log, fe.log_line) == ("h1n2/rank3.log", 11)
    assert fe.log_path == str(KEYERROR_RUN / "h1n2" / "rank3.log")
    assert fe.traceback[-1] == "[rank3]: KeyError: 'batch_size'" and fe.explained_by == ()
    # no cause is invented for the KeyError; the peers' errors are its consequence
    assert [(d.rule_id, d.consequence) for d in report.diagnoses] == [("peer-process-exited", True)]
    assert report.diagnoses[0].ranks == (2, 4, 5)
    assert report.found


def test_cli_lists_the_first_failure_before_its_consequences():
    result = _invoke(str(KEYERROR_RUN))
    assert result.exit_code == 0, result.output
    out = result.output
    first = out.index("1. rank 3 on h1n2 failed first: KeyError: 'batch_size' (crash_rank3.py:9)")
    assert f"log: {KEYERROR_RUN / 'h1n2' / 'rank3.log'}:11" in out
    assert "No known failure signature matches this exception" in out
    second = out.index("2. Consequence of the first failure: A peer rank went away")
    assert first < second and "Likely cause" not in out
    data = json.loads(_invoke(str(KEYERROR_RUN), "--json").output)
    assert data["first_error"]["summary"] == "rank 3 on h1n2 failed first: KeyError: 'batch_size' (crash_rank3.py:9)"
    assert data["first_error"]["where"] == "crash_rank3.py:9"
    assert data["failure"]["exception"] == "KeyError: 'batch_size'"
    assert (data["found"], data["matched"], data["hang"]) == (True, True, None)
    assert [(d["rule_id"], d["consequence"]) for d in data["diagnoses"]] == [("peer-process-exited", True)]


def test_first_failure_without_any_rule_is_still_found(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(KEYERROR_RUN, run)
    for name in ("rank2.log", "launcher.log"):
        (run / "h1n2" / name).unlink()
    shutil.rmtree(run / "h1n3")
    result = _invoke(str(run))
    assert result.exit_code == 0, result.output
    assert "rank 3 on h1n2 failed first: KeyError: 'batch_size'" in result.output
    assert "no known failure signature matched" not in result.output
    assert diagnose_path(run) == []  # still no rule: a KeyError is the program's own error


# Real 1-node runs (corral run -n 2, torchrun, gloo) whose rank 1 left no traceback:
# argparse rejected its arguments (exit 2); it was SIGKILLed (as the OOM killer does).
# The scripts that made them are kept beside the logs.
ARGPARSE_RUN = FIXTURES / "run-argparse-rank1"
SIGKILL_RUN = FIXTURES / "run-sigkill-rank1"


def test_first_rank_without_traceback_is_named_with_its_last_lines():
    fe = diagnose_run(ARGPARSE_RUN).first_error
    assert fe.summary == "rank 1 on vm failed first: exited with code 2"
    assert fe.kind == "exit" and (fe.log, fe.log_line) == ("vm/rank1.log", 2)
    assert fe.traceback[-1] == "train_args.py: error: unrecognized arguments: --batch-size 64"
    assert fe.explained_by == ()
    out = _invoke(str(ARGPARSE_RUN)).output
    assert "1. rank 1 on vm failed first: exited with code 2" in out
    assert out.index("last lines it wrote:") < out.index("error: unrecognized arguments") \
        < out.index("2. Consequence of the first failure")
    assert "argparse prints" in out


def test_sigkilled_first_rank_is_explained_by_its_launchers_report():
    report = diagnose_run(SIGKILL_RUN)
    fe = report.first_error
    assert fe.summary == "rank 1 on vm failed first: killed by SIGKILL"
    assert fe.traceback == ("rank 1 loading shard", "allocating 40 GiB of host buffers")
    assert fe.explained_by == ("host-oom-killed",)  # torchrun's "Signal 9 (SIGKILL)" in launcher.log
    assert [(d.rule_id, d.consequence) for d in report.diagnoses][0] == ("host-oom-killed", False)
    out = _invoke(str(SIGKILL_RUN)).output
    assert "(3 log file(s); first failure: vm rank 1, SIGKILL)" in out
    assert "explained below by rule host-oom-killed" in out and "allocating 40 GiB" in out
    data = json.loads(_invoke(str(SIGKILL_RUN), "--json").output)
    assert data["first_error"]["kind"] == "exit"


def test_first_failure_explained_by_a_rule_says_so(tmp_path):
    run = _run_dir(tmp_path)
    (run / "node2" / "rank3.log").write_text(fixture("nccl-backend-unavailable.2.log"))
    report = diagnose_run(run)
    assert report.first_error.summary == ("rank 3 on node2 failed first: RuntimeError: Distributed package "
                                          "doesn't have NCCL built in (nanogpt_nccl.py:34)")
    assert report.first_error.explained_by == ("nccl-backend-unavailable",)
    assert report.diagnoses[0].rule_id == "nccl-backend-unavailable"
    assert "explained below by rule nccl-backend-unavailable" in _invoke(str(run)).output


def test_a_symptom_on_the_first_failing_rank_is_not_a_consequence(tmp_path):
    run = _run_dir(tmp_path)
    (run / "node2" / "rank3.log").write_text(fixture("peer-process-exited.log"))
    echo = next(d for d in diagnose_run(run).diagnoses if d.rule_id == "peer-process-exited")
    assert (echo.host, echo.rank, echo.consequence) == ("node2", 3, False)


def test_hung_run_names_the_rank_elsewhere_and_its_frame():
    report = diagnose_run(HANG_RUN)
    hang = report.hang
    assert report.first_error is None and report.found
    assert hang.odd_ranks == (4,)
    odd, rest = hang.groups
    assert (odd.ranks, odd.frame, odd.hosts, odd.odd) == ((4,), "read_shard hang_rank.py:9", ("h1n3",), True)
    assert (rest.ranks, rest.frame, rest.user_frame) == \
        ((0, 1, 2, 3, 5), "all_reduce distributed_c10d.py:3252", "main hang_rank.py:17")
    # run.json names the stacks file where the run was; the copy in the run directory is read
    assert hang.stacks_file == str(HANG_RUN / "stacks-122436.txt")
    assert hang.summary == ("the job hung (no progress for 20s): rank 4 on h1n3 at read_shard "
                            "hang_rank.py:9, elsewhere than the others")
    # torchrun's "Received 15 death signal" on the odd rank's node is corral's own teardown
    assert [(d.rule_id, d.consequence) for d in report.diagnoses] == [("launcher-sigterm", True)]


def test_cli_reports_a_hang_and_exits_0():
    result = _invoke(str(HANG_RUN))
    assert result.exit_code == 0, result.output
    assert "1. The job hung (no progress for 20s): rank 4 on h1n3 at read_shard hang_rank.py:9" in result.output
    assert f"stacks: {HANG_RUN / 'stacks-122436.txt'}" in result.output
    assert "no known failure signature matched" not in result.output
    data = json.loads(_invoke(str(HANG_RUN), "--json").output)
    assert data["found"] is True and data["hang"]["odd_ranks"] == [4]
    assert data["hang"]["groups"][0]["frame"] == "read_shard hang_rank.py:9"


def test_hang_inside_init_process_group_says_the_ranks_never_met():
    hang = diagnose_run(HANG_INIT_RUN).hang
    assert hang.in_init and not hang.odd_ranks and not hang.missing
    assert [g.user_frame for g in hang.groups] == ["setup ddp_file.py:31"]
    result = _invoke(str(HANG_INIT_RUN))
    assert result.exit_code == 0, result.output
    assert "every rank is still inside init_process_group: the ranks never met" in result.output
    assert "init_method='file://...' on each node's own disk" in result.output
    assert json.loads(_invoke(str(HANG_INIT_RUN), "--json").output)["hang"]["in_init"] is True
    # a hang elsewhere (rank 4 reading a shard, the rest in all_reduce) is not one
    assert diagnose_run(HANG_RUN).hang.in_init is False


def test_hang_without_its_stacks_file_uses_run_json(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(HANG_RUN, run)
    (run / "stacks-122436.txt").unlink()
    record = run / "run.json"  # the run's original directory is gone too
    record.write_text(record.read_text().replace("/tmp/h1/runs/20261123-122412-4a3d", str(tmp_path / "gone")))
    hang = diagnose_run(run).hang
    assert (hang.odd_ranks, hang.groups, hang.stacks_file) == ((4,), (), None)
    assert hang.summary == "the job hung (no progress for 20s): rank 4 elsewhere than the others"


def test_run_that_did_not_hang_has_no_hang(tmp_path):
    assert diagnose_run(_run_dir(tmp_path)).hang is None
    assert diagnose_run(KEYERROR_RUN).hang is None


def test_succeeded_run_says_so(tmp_path):
    run = tmp_path / "run1"
    (run / "node1").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"status": "succeeded", "failure": None}))
    (run / "node1" / "rank0.log").write_text(fixture("negative-clean-run.log"))
    result = _invoke(str(run))
    assert result.exit_code == 1
    assert "run.json records that this run succeeded" in result.output


def test_missing_path_is_a_usage_error(tmp_path):
    from corral.errors import UsageError

    with pytest.raises(UsageError, match="no such file"):
        diagnose_path(tmp_path / "nope.log")


# ------------------------------------------------------------------ CLI


def _invoke(*args: str, input: str | bytes | None = None):
    return CliRunner().invoke(cli, ["diagnose", *args], input=input)


def test_cli_report_shows_cause_lines_and_fix():
    result = _invoke(str(FIXTURES / "nccl-duplicate-gpu.log"))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "Likely cause: Two ranks on one node use the same GPU" in out
    assert "line 4" in out and "Duplicate GPU detected : rank 0 and rank 1" in out
    assert "torch.cuda.set_device" in out and "confidence 0.96" in out


def test_cli_run_dir_names_where(tmp_path):
    result = _invoke(str(_run_dir(tmp_path)))
    assert result.exit_code == 0, result.output
    assert "first failure: node2 rank 3" in result.output
    assert "node2/rank3.log:20" in result.output
    assert re.search(r"node2 rank 3", result.output)


def test_cli_json(tmp_path):
    result = _invoke(str(FIXTURES / "ssh-host-key-changed.log"), "--json")
    assert result.exit_code == 0
    data = json.loads(result.output)
    assert data["matched"] is True and data["kind"] == "file"
    top = data["diagnoses"][0]
    assert top["rule_id"] == "ssh-host-key-changed"
    assert top["lines"][0]["line"] == 2 and top["fix"]


def test_cli_nothing_matched_exits_1(tmp_path):
    unknown = tmp_path / "unknown.log"
    unknown.write_text("step 1 loss 2.0\nfatal: the frobnicator gave up\n", encoding="utf-8")
    result = _invoke(str(unknown))
    assert result.exit_code == 1
    assert "no known failure signature matched" in result.output
    data = json.loads(_invoke(str(FIXTURES / "negative-clean-run.log"), "--json").output)
    assert data == {**data, "matched": False, "diagnoses": [], "failure_lines": []}
    assert json.loads(_invoke(str(unknown), "--json").output)["failure_lines"] == [
        {"line": 2, "text": "fatal: the frobnicator gave up"}]


def test_cli_missing_file_exits_2(tmp_path):
    result = _invoke(str(tmp_path / "missing.log"))
    assert result.exit_code == 2
    assert "missing.log: no such file or directory" in result.output


def _runs(tmp_path: Path, *ids: str) -> Path:
    for run_id in ids:
        shutil.copytree(KEYERROR_RUN, tmp_path / "runs" / run_id)
    return tmp_path / "runs"


def test_cli_accepts_a_run_id_or_a_unique_prefix(tmp_path, monkeypatch):
    _runs(tmp_path, "20261123-122356-cd38", "20261123-130000-beef")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CORRAL_RUNS_DIR", raising=False)
    for target in ("20261123-122356-cd38", "20261123-1223"):
        result = _invoke(target)
        assert result.exit_code == 0, result.output
        assert "corral diagnose runs/20261123-122356-cd38 " in result.output
        assert "rank 3 on h1n2 failed first: KeyError" in result.output
    data = json.loads(_invoke("20261123-1223", "--json").output)
    assert data["path"] == str(Path("runs") / "20261123-122356-cd38")


def test_cli_run_id_errors_are_clear(tmp_path, monkeypatch):
    _runs(tmp_path, "20261123-122356-cd38", "20261123-130000-beef")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CORRAL_RUNS_DIR", raising=False)
    ambiguous = _invoke("20261123")
    assert ambiguous.exit_code == 2
    assert "20261123: matches 2 runs in runs: 20261123-122356-cd38, 20261123-130000-beef" in ambiguous.output
    missing = _invoke("20990101")
    assert missing.exit_code == 2
    assert "20990101: no such file or directory, and no run id starting with it in runs" in missing.output


def test_cli_run_id_honours_corral_runs_dir(tmp_path, monkeypatch):
    runs = _runs(tmp_path / "elsewhere", "20261123-122356-cd38")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CORRAL_RUNS_DIR", str(runs))
    result = _invoke("20261123-1223")
    assert result.exit_code == 0, result.output
    assert str(runs / "20261123-122356-cd38") in result.output


def test_cli_run_id_in_runs_dir_flag(tmp_path, monkeypatch):
    runs = _runs(tmp_path / "other", "20261123-122356-cd38")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CORRAL_RUNS_DIR", raising=False)
    result = _invoke("20261123-1223", "--runs-dir", str(runs))
    assert result.exit_code == 0, result.output
    assert str(runs / "20261123-122356-cd38") in result.output


def test_cli_all_and_stdin():
    text = fixture("ssh-permission-denied.log")
    short = _invoke("-", input=text)
    assert short.exit_code == 0 and "ssh refused the key" in short.output
    log = fixture("nccl-system-error.log") + fixture("cuda-oom.log") + fixture("rendezvous-timeout.log")
    log += fixture("address-in-use.log")
    hidden = _invoke("-", input=log)
    assert "rerun with --all" in hidden.output
    everything = _invoke("-", "--all", input=log)
    assert "4. Also possible" in everything.output


def test_cli_stdin_from_windows_powershell_is_decoded():
    # `... | Out-File log.txt` / `>` in Windows PowerShell writes UTF-16 with a BOM.
    text = fixture("ssh-permission-denied.log")
    res = _invoke("-", input=text.encode("utf-16"))
    assert res.exit_code == 0 and "ssh refused the key" in res.output


def test_where_without_a_first_host_lists_the_hosts_plainly():
    from corral.cli.diagnose import _where

    [d] = [d for d in diagnose_text("unhandled system error\nnode2: unhandled system error\n")
           if d.rule_id == "nccl-system-error"]
    assert (d.host, d.hosts) == (None, ("node2",))
    assert _where(d) == "seen on node2"


def test_cli_facts_flag(tmp_path):
    facts = tmp_path / "facts.json"
    facts.write_text(json.dumps([_facts("node2", ib=[])]))
    result = _invoke(str(FIXTURES / "nccl-system-error.log"), "--facts", str(facts))
    assert result.exit_code == 0
    assert "node2 has no InfiniBand device: set NCCL_IB_DISABLE=1" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert _invoke(str(FIXTURES / "cuda-oom.log"), "--facts", str(bad)).exit_code == 2


def test_log_lines_keep_physical_line_numbers():
    lines = list(iter_text("a\n\nb\rc\n"))
    assert [(ln.number, ln.text) for ln in lines] == [(1, "a"), (3, "b"), (3, "c")]


# ------------------------------------------------------------------ tracebacks


def test_last_traceback_gives_the_exception_and_the_innermost_user_frame():
    from corral.diagnose.pyexc import parse_traceback

    text = (
        "step 1\n"
        "Traceback (most recent call last):\n"
        '  File "/srv/app/train.py", line 40, in <module>\n'
        "    main()\n"
        '  File "/srv/app/train.py", line 31, in main\n'
        "    batch = next(it)\n"
        "            ^^^^^^^^\n"
        '  File "/opt/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 631, in __next__\n'
        "    data = self._next_data()\n"
        "ValueError: first\n"
        "\n"
        "During handling of the above exception, another exception occurred:\n"
        "\n"
        "Traceback (most recent call last):\n"
        '  File "/srv/app/train.py", line 44, in <module>\n'
        "    cleanup()\n"
        '  File "/usr/lib/python3.11/shutil.py", line 9, in rmtree\n'
        "    os.rmdir(path)\n"
        "OSError: [Errno 39] Directory not empty: 'ckpt'\n"
        "    more message\n"
    )
    exc = parse_traceback(iter_text(text))
    assert (exc.text, exc.type, exc.line) == ("OSError: [Errno 39] Directory not empty: 'ckpt'", "OSError", 19)
    assert exc.user_frame.short == "train.py:44"  # the standard library's shutil is not the program
    first = parse_traceback(iter_text(text.split("\nDuring")[0]))
    assert (first.text, first.user_frame.short) == ("ValueError: first", "train.py:31")


def test_traceback_parsing_handles_windows_paths_syntax_errors_and_half_tracebacks():
    from corral.diagnose.pyexc import last_exception, parse_traceback

    exc = last_exception(FIXTURES / "nccl-backend-unavailable.log")  # Windows paths, mp.spawn
    assert exc.text == "RuntimeError: Distributed package doesn't have NCCL built in"
    assert exc.user_frame.short == "train.py:44" and exc.user_frame.func == "train"
    syntax = parse_traceback(iter_text(
        'Traceback (most recent call last):\n  File "/w/t.py", line 3\n    foo(\n       ^\n'
        "SyntaxError: '(' was never closed\n"))
    assert (syntax.type, syntax.user_frame.short, syntax.user_frame.func) == ("SyntaxError", "t.py:3", None)
    # a traceback cut off before its exception line names nothing
    assert parse_traceback(iter_text('Traceback (most recent call last):\n  File "/w/t.py", line 3, in f\n')) is None
    assert last_exception(FIXTURES / "negative-clean-run.log") is None


def test_traceback_after_a_partial_line_is_still_the_rank_s_exception(tmp_path):
    """print("loading checkpoint ... ", end="") and then a crash: the header is mid-line."""
    from corral.diagnose.pyexc import last_exception

    log = tmp_path / "rank1.log"
    log.write_text("step 1\nloading checkpoint ckpt/last.pt ... Traceback (most recent call last):\n"
                   '  File "/work/train.py", line 12, in <module>\n'
                   "    state = torch.load(path)\n"
                   "FileNotFoundError: [Errno 2] No such file or directory: 'ckpt/last.pt'\n")
    exc = last_exception(log)
    assert exc is not None and exc.type == "FileNotFoundError"
    assert exc.user_frame is not None and exc.user_frame.line == 12


def test_a_rank_that_left_early_comes_first(tmp_path):
    """A real run (corral run -n 2): rank 0 returned early, rank 1 lost it in a barrier."""
    run = FIXTURES / "run-early-exit-rank0"
    report = diagnose_run(run)
    assert report.failure.left_early == (("vm", 0),)
    out = _invoke(str(run)).output
    first = out.index("1. rank 0 on vm had already exited without an error")
    assert first < out.index("2. rank 1 on vm failed first")
    data = json.loads(_invoke(str(run), "--json").output)
    assert data["failure"]["left_early"] == [{"host": "vm", "rank": 0}]


def test_a_native_crash_names_the_program_line_from_faulthandler():
    """A real run: rank 1 segfaulted in ctypes; corral's rank hook enabled faulthandler."""
    run = FIXTURES / "run-segv-rank1"
    fe = diagnose_run(run).first_error
    assert fe.summary == "rank 1 on vm failed first: killed by SIGSEGV (segv.py:3)"
    assert (fe.func, fe.line) == ("decode_batch", 3)
    assert fe.traceback[0] == "Fatal Python error: Segmentation fault"
    out = _invoke(str(run)).output
    # the native-crash rule explains it (its stack, from faulthandler, is shown above it)
    assert "explained below by rule native-crash" in out and "segv.py\", line 3 in decode_batch" in out.replace("/tmp/fx/", "")


def test_an_interrupted_run_blames_the_interruption_not_a_peer():
    """A real 2-node run stopped with Ctrl-C while rank 1 waited for data."""
    run = FIXTURES / "run-interrupted"
    report = diagnose_run(run)
    assert report.status == "interrupted"
    assert all(d.consequence for d in report.diagnoses if d.symptom)
    out = _invoke(str(run)).output
    assert "was interrupted (Ctrl-C or SIGTERM" in out and "Likely cause: A peer rank went away" not in out


def test_an_interrupted_run_where_nothing_failed_is_not_an_unknown_failure(tmp_path):
    """Ctrl-C during a DeepSpeed run's start-up: the launcher's 'received SIGINT' and clean rank logs."""
    run = tmp_path / "runs" / "20261123-231650-d51c"
    (run / "node1").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run.name, "status": "interrupted", "exit_code": 130,
                                              "hosts": [], "failure": None}))
    (run / "node1" / "rank0.log").write_text(
        "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully\n")
    (run / "node1" / "launcher.log").write_text(
        "[2026-11-23 23:16:59,024] [INFO] [launch.py:253:sigkill_handler] Killing subprocess 477\n"
        "[2026-11-23 23:16:59,083] [INFO] [launch.py:262:sigkill_handler] Main process received SIGINT, exiting\n")
    result = _invoke(str(run))
    assert "No rank had failed before the interruption: nothing to diagnose" in result.output
    assert "no known failure signature matched" not in result.output and "NCCL_DEBUG" not in result.output


def test_no_target_diagnoses_the_newest_run_that_did_not_succeed(tmp_path, monkeypatch):
    monkeypatch.delenv("CORRAL_RUNS_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    missing = _invoke()
    assert missing.exit_code == 2 and "no failed run in runs" in missing.output
    runs = tmp_path / "runs"
    runs.mkdir()
    shutil.copytree(KEYERROR_RUN, runs / "20261123-122356-cd38")
    ok = runs / "20261124-000000-aaaa"  # newer, but it succeeded
    ok.mkdir()
    (ok / "run.json").write_text(json.dumps({"status": "succeeded", "started": 1.0}))
    result = _invoke()
    assert result.exit_code == 0, result.output
    assert "rank 3 on h1n2 failed first: KeyError: 'batch_size'" in result.output


# ------------------------------------------------- third sandbox gauntlet (torch 2.13, 3 nodes)


def test_store_wait_timeout_of_torch_2_13_names_the_missing_rank():
    top = diagnose_path(FIXTURES / "store-waiting-for-clients.3.log")[0]
    assert (top.rule_id, top.captures["missing_rank"]) == ("store-waiting-for-clients", "2")
    assert top.fix[0].startswith("The store key names rank 2")
    # a key without gloo's rank suffix (NCCL's unique id) is still a store wait timeout, naming no rank
    (d,) = diagnose_text("torch.distributed.DistStoreError: wait timeout after 1800000ms, keys: /default_pg//cuda//0")
    assert d.rule_id == "store-waiting-for-clients" and "missing_rank" not in d.captures


def test_file_store_timeout_is_not_a_tcp_store_timeout():
    assert diagnose_path(FIXTURES / "file-store-not-shared.log")[0].rule_id == "file-store-not-shared"
    assert "file-store-not-shared" not in {d.rule_id for d in diagnose_path(FIXTURES / "store-waiting-for-clients.3.log")}
    assert diagnose_text("RuntimeError: Wait timeout while reading the queue") == []


def test_cpu_only_torch_build():
    for name in ("torch-cpu-only-build.log", "torch-cpu-only-build.2.log"):
        top = diagnose_path(FIXTURES / name)[0]
        assert top.rule_id == "torch-cpu-only-build"
        assert any("gloo" in step for step in top.fix)


# A real 3-node run: rank 0 torch.save("checkpoints/init.pt"), barrier, every rank loads it; disks are node-private.
NODE_LOCAL_FILE_RUN = FIXTURES / "run-node-local-file"
# A real 3-node run of the DDP tutorial's setup(): MASTER_ADDR='localhost', MASTER_PORT='12355'.
OWN_MASTER_ADDR_RUN = FIXTURES / "run-own-master-addr"


def test_file_missing_on_other_nodes_only_is_a_node_local_disk():
    report = diagnose_run(NODE_LOCAL_FILE_RUN)
    top = report.diagnoses[0]
    assert top.rule_id == "file-on-some-nodes-only" and not top.consequence
    assert top.title == "'checkpoints/init.pt' is missing on g2, g3 but not on g1: the nodes do not share that directory"
    assert (top.hosts, top.ranks) == (("g2", "g3"), (1, 2))
    assert any("dist.broadcast_object_list" in step for step in top.fix)
    assert any("corral sync" in step for step in top.fix)
    assert report.first_error.explained_by[0] == "file-on-some-nodes-only"


def test_file_missing_everywhere_is_not_blamed_on_the_disks(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(NODE_LOCAL_FILE_RUN, run)
    (run / "g1" / "rank0.log").write_text((run / "g2" / "rank1.log").read_text().replace("[rank1]", "[rank0]"))
    assert "file-on-some-nodes-only" not in {d.rule_id for d in diagnose_run(run).diagnoses}
    # a single log cannot tell: no node comparison
    assert diagnose_path(run / "g2" / "rank1.log") == []


def test_loopback_store_in_a_multi_node_run_is_the_script_overriding_master_addr(tmp_path):
    top = diagnose_run(OWN_MASTER_ADDR_RUN).diagnoses[0]
    assert top.rule_id == "store-unreachable"
    assert top.title.startswith("The script sets its own MASTER_ADDR/MASTER_PORT (localhost:12355)")
    assert "10.202.60.11:47303" in top.fix[0] and "Remove those lines" in top.fix[0]
    # the same log on its own keeps the generic diagnosis
    (one,) = diagnose_path(OWN_MASTER_ADDR_RUN / "g2" / "rank1.log")
    assert one.title == "Cannot connect to the rendezvous store (MASTER_ADDR:MASTER_PORT)"
    # a run whose own store is on loopback (one node) is not told that
    run = tmp_path / "run"
    shutil.copytree(OWN_MASTER_ADDR_RUN, run)
    record = json.loads((run / "run.json").read_text())
    record["master_addr"] = "127.0.0.1"
    (run / "run.json").write_text(json.dumps(record))
    assert diagnose_run(run).diagnoses[0].title == "Cannot connect to the rendezvous store (MASTER_ADDR:MASTER_PORT)"


def test_cli_single_log_with_a_plain_exception_names_it_not_nccl_debug():
    result = _invoke(str(NODE_LOCAL_FILE_RUN / "g2" / "rank1.log"))
    assert result.exit_code == 1, result.output
    out = " ".join(result.output.split())
    assert "The log ends with a Python exception: FileNotFoundError: [Errno 2] No such file or directory: " \
           "'checkpoints/init.pt' (sharedfs.py:9)" in out
    assert "NCCL_DEBUG" not in out and "corral diagnose <run-dir>" in out
    data = json.loads(_invoke(str(NODE_LOCAL_FILE_RUN / "g2" / "rank1.log"), "--json").output)
    assert data["exception"]["where"] == "sharedfs.py:9"
    # a log with an error no rule knows (and no traceback) keeps the general hint
    assert "NCCL_DEBUG=WARN" in _invoke("-", input="NCCL WARN something odd happened\n").output


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.log")))
def test_grep_prefilter_finds_what_line_by_line_matching_finds(name):
    """The file path (grep picks the lines) must not lose or misnumber a line either."""
    slow = Matcher().feed_all(iter_text(fixture(name))).diagnoses()
    fast = Matcher().feed_file(FIXTURES / name).diagnoses()
    assert [(d.rule_id, [m.line for m in d.lines]) for d in fast] == \
        [(d.rule_id, [m.line for m in d.lines]) for d in slow]


def test_colour_codes_inside_an_error_line_do_not_hide_it_from_grep(tmp_path):
    path = tmp_path / "coloured.log"
    path.write_text("step 1 loss 2.0\n[rank1]: RuntimeError: Default process group has "
                    "\x1b[1mnot\x1b[0m been \x1b[31minitial\x1b[0mized\nstep 2\n", encoding="utf-8")
    (top,) = diagnose_path(path)
    assert (top.rule_id, top.lines[0].line, top.rank) == ("process-group-not-initialized", 2, 1)


def test_ordinary_training_lines_never_reach_the_rules(tmp_path, monkeypatch):
    """Every rule's literal must be rarer than a training line: a literal that
    ordinary output prints ("loss") sends every line through ~400 regexes."""
    lines = [f"[r{i % 8}] step {i} | loss {i % 97 / 10:.4f} | lr 3.0e-04 | grad_norm 0.5 | 120 samples/s"
             for i in range(200)]
    lines += [f"node{i % 4}: {{'loss': 1.{i:03d}, 'learning_rate': 2e-05, 'epoch': 0.{i:02d}}}" for i in range(200)]
    lines += [f"[node1/r3] Epoch 1:  {i % 100}%|###       | {i}/500 [00:12<00:30, 5.1it/s, loss=2.{i:02d}]"
              for i in range(200)]
    # other launchers' progress lines (DeepSpeed, Megatron, Lightning, torchtitan, fairseq)
    lines += [
        "[2024-01-01 12:00:00,000] [INFO] [logging.py:96:log_dist] [Rank 0] step=100, skipped=0, lr=[0.0003]",
        "steps: 100 loss: 2.3456 iter time (s): 0.512 samples/sec: 64.2",
        "[2024-01-01 12:00:00,000] [INFO] [timer.py:260:stop] epoch=0/micro_step=100/global_step=100, "
        "RunningAvgSamplesPerSec=61.2, CurrSamplesPerSec=63.0, MemAllocated=12.3GB, MaxMemAllocated=20.1GB",
        " iteration      100/  500000 | consumed samples:        51200 | lm loss: 6.123456E+00 | loss scale: "
        "65536.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |",
        "Epoch 0:  10%|#         | 100/1000 [00:50<07:30,  2.00it/s, v_num=0, train_loss=2.340]",
        "[titan] 2024-01-01 12:00:00,000 - root - INFO - step:  10  loss:  9.8765  memory: 30.12GiB(31.7%)",
        "2024-01-01 12:00:00 | INFO | fairseq.trainer | begin training epoch 1",
    ] * 20
    path = tmp_path / "train.log"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    fed: list[str] = []
    real_feed = Matcher.feed
    monkeypatch.setattr(Matcher, "feed", lambda self, line: (fed.append(line.text), real_feed(self, line)))
    assert diagnose_path(path) == []
    assert fed == []
    assert prefilter.literals(re.compile(r"loss\W{1,3}nan\b")) == ["nan"]


def test_grep_is_stopped_when_the_caller_stops_reading(tmp_path):
    path = tmp_path / "many.log"
    path.write_text("NCCL WARN x\n" * 200_000, encoding="utf-8")
    scan = prefilter.grep_scan(shutil.which("grep"), path, ["NCCL WARN"], 8192)
    assert next(scan) == (1, "NCCL WARN x")
    scan.close()  # the generator's finally kills and reaps grep: no process is left behind


def test_last_exception_of_a_big_log_is_read_from_its_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(prefilter, "CHUNK", 61)  # headers and frames cut by block boundaries
    path = tmp_path / "rank.log"
    body = "".join(f"step {i}\n" for i in range(300))
    tb = ('Traceback (most recent call last):\n  File "/w/a.py", line 3, in <module>\n    f()\n'
          "ValueError: first\n")
    tb2 = ('[rank1]: Traceback (most recent call last):\n[rank1]:   File "/w/train.py", line 9, in <module>\n'
           "[rank1]:     x = batch['size']\n[rank1]: KeyError: 'size'\n")
    path.write_text(body + tb + body + tb2 + "tail line\n", encoding="utf-8")
    exc = last_exception(path)
    assert (exc.text, exc.line, exc.user_frame.line) == ("KeyError: 'size'", 300 + 4 + 300 + 4, 9)


LOST_NODE_RUN = FIXTURES / "run-lost-node"  # README's demo: `corral sandbox partition` mid-run, recorded


def test_lost_node_is_the_finding_not_a_consequence_of_itself():
    report = diagnose_run(LOST_NODE_RUN)
    top = report.diagnoses[0]
    assert top.rule_id == "node-lost" and not top.consequence
    assert top.title == "d14790n3 was lost: no heartbeat for 10 s (network partition or frozen host)"
    assert top.hosts == ("d14790n3",) and top.ranks == (4, 5)
    assert any("ping d14790n3" in step for step in top.fix)
    assert all(m.host == "d14790n3" for m in top.lines)  # the last lines the lost node wrote
    # the other nodes' SIGTERM is corral's teardown: a consequence, listed after it
    assert all(d.consequence for d in report.diagnoses[1:] if d.symptom)
    out = _invoke(str(LOST_NODE_RUN)).output
    assert "1. Likely cause: d14790n3 was lost: no heartbeat for 10 s" in out
    assert "rerun" not in out.split("2. ")[0].lower()


def test_run_json_reason_without_seconds_is_shown_as_is(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(LOST_NODE_RUN, run)
    record = json.loads((run / "run.json").read_text())
    record["failure"]["reason"] = "the agent connection is closed"
    (run / "run.json").write_text(json.dumps(record))
    top = diagnose_run(run).diagnoses[0]
    assert top.title == "d14790n3 was lost: the agent connection is closed (network partition or frozen host)"


@pytest.mark.sandbox
def test_partitioned_node_of_a_real_run_is_diagnosed_as_lost(sandbox, tmp_path):
    import subprocess
    import sys
    import time

    work = Path(__file__).resolve().parents[1] / "scratch" / f"diag-lost-{time.monotonic_ns()}"
    work.mkdir(parents=True)
    try:
        (work / "loop.py").write_text(
            "import time, torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\nprint('ready', dist.get_rank(), flush=True)\n"
            "for _ in range(100000):\n    dist.all_reduce(torch.ones(1)); time.sleep(0.2)\n")
        proc = subprocess.Popen([sys.executable, "-m", "corral", "run", "-c", str(sandbox.cluster_file),
                                 "loop.py"], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        victim = sandbox.nodes[2]
        try:
            ready = 0
            for line in proc.stdout:
                ready += "] ready " in line
                if ready == 8:
                    break
            sandbox.partition(victim)
            proc.communicate(timeout=90)
        finally:
            sandbox.heal(victim)
            if proc.poll() is None:
                proc.kill()
        (run,) = Path(os.environ["CORRAL_RUNS_DIR"]).iterdir()  # conftest's, per test
        top = diagnose_run(run).diagnoses[0]
        assert top.rule_id == "node-lost" and top.host == victim
        assert top.title.startswith(f"{victim} was lost: no heartbeat for ")
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------ logs without a failure

NO_FAILURE_LOGS = ["negative-clean-run.log", "negative-benign-warnings.log", "negative-nccl-info.log",
                   "negative-deepspeed-megatron-steps.log", "negative-torchtitan-srun-steps.log"]


@pytest.mark.parametrize("name", NO_FAILURE_LOGS)
def test_a_log_without_a_failure_says_so_and_suggests_no_nccl_debugging(name):
    report = diagnose_run(FIXTURES / name)
    assert not report.found and report.failure_lines == ()
    result = _invoke(str(FIXTURES / name))
    assert "No failure found" in result.output
    assert "NCCL_DEBUG" not in result.output and "no known failure signature" not in result.output
    assert result.exit_code == 1


def test_an_unknown_error_is_not_called_no_failure():
    result = _invoke("-", input="step 1 loss 2.0\nRuntimeError: the flux capacitor is cold\n")
    assert "No failure found" not in result.output
    assert "line 2  RuntimeError: the flux capacitor is cold" in result.output
    assert "no known failure signature matched" in result.output


def test_sockets_instead_of_infiniband_is_a_notice_after_the_causes(tmp_path):
    report = diagnose_run(FIXTURES / "nccl-ib-fallback.log")
    assert [(d.rule_id, d.notice) for d in report.diagnoses] == [("nccl-ib-fallback", True)]
    assert not report.found
    assert "Worth knowing (not a failure): NCCL is using TCP sockets" in _invoke(
        str(FIXTURES / "nccl-ib-fallback.log")).output
    both = tmp_path / "both.log"
    both.write_text(fixture("nccl-ib-fallback.log") + fixture("nccl-socket-family.log"), encoding="utf-8")
    assert [d.rule_id for d in diagnose_path(both)] == ["nccl-socket-family", "nccl-ib-fallback"]
    # IB switched off on purpose: nothing to say
    off = tmp_path / "off.log"
    off.write_text("h:1:1 [0] NCCL INFO NCCL_IB_DISABLE set by environment to 1.\n"
                   + fixture("nccl-ib-fallback.log"), encoding="utf-8")
    assert diagnose_path(off) == []


FAMILIES = FIXTURES / "families"
_FAMILY_LOGS = tomllib.loads((FAMILIES / "families.toml").read_text(encoding="utf-8"))["log"]


@pytest.mark.parametrize("entry", _FAMILY_LOGS, ids=[f"{e['split']}-{Path(e['file']).name}" for e in _FAMILY_LOGS])
def test_real_logs_of_the_issue_families_name_the_right_cause(entry):
    """Real wordings of sshd/pdsh/c10d/NCCL/DeepSpeed failures (dev and held-out,
    see families.toml and bench/score_diagnose.py) are diagnosed with their cause."""
    diags = diagnose_path(FAMILIES / entry["file"])
    if entry.get("notice"):
        assert [d.rule_id for d in diags if d.notice] == entry["expect"]
    else:
        causes = [d.rule_id for d in diags if not d.notice]
        assert causes and causes[0] in entry["expect"], causes


def test_a_literal_set_too_long_for_one_grep_argument_takes_the_python_scan(tmp_path):
    assert prefilter.grep_path("utf-8", ["x" * 60_000]) is None
    assert prefilter.grep_path("utf-16", ["NCCL WARN"]) is None
    assert prefilter.grep_path("utf-8", ["NCCL WARN"]) == shutil.which("grep")


def test_a_notice_is_never_handed_out_as_a_failed_runs_cause():
    """corral run's summary takes diagnose_text's first entries as the likely cause."""
    text = fixture("nccl-ib-fallback.log")
    assert diagnose_text(text) == []
    assert [d.rule_id for d in diagnose_text(text, notices=True)] == ["nccl-ib-fallback"]
    assert "Worth knowing (not a failure)" in _invoke("-", input=text).output


@pytest.mark.parametrize("name", ["slurm-time-limit.log", "cuda-invalid-device-ordinal.2.log",
                                  "nccl-peer-gpu-not-visible.log", "lightning-slurm-ntasks-mismatch.log",
                                  "nccl-duplicate-rank.log", "address-in-use.log"])
def test_slurm_symptoms_offer_corral_check_on_the_batch_script(name):
    """A time limit with no checkpoint, an invalid device ordinal, ranks that all
    say 0, a shared port: the batch script is the usual cause, and `corral check`
    names its line."""
    top = diagnose_path(FIXTURES / name)[0]
    assert any("`corral check job.sbatch`" in step for step in top.fix), top.fix


def test_a_hung_runs_flight_recorder_dumps_name_the_rank_and_the_collective(tmp_path):
    # A run ended by --hang-timeout, with the dumps and stacks file corral saved
    # (recorded: tests/fixtures/flightrec/README.md); rank 3 went on to the barrier.
    recorded = Path(__file__).parent / "fixtures" / "flightrec" / "skip"
    run = tmp_path / "runs" / "20261127-192416-8379b8"
    shutil.copytree(recorded, run / "flightrec")
    shutil.move(run / "flightrec" / "stacks.txt", run / "stacks-192454.txt")
    (run / "vm").mkdir()
    (run / "vm" / "rank0.log").write_text("step 0\nstep 10\nstep 20\nstep 30\nstep 40\n")
    (run / "run.json").write_text(json.dumps({
        "run_id": run.name, "status": "failed", "exit_code": 124, "world_size": 4,
        "failure": {"host": "vm", "rank": 3, "kind": "hang", "exit_code": 124,
                    "reason": "no progress for 25s; rank 3 elsewhere than the others (stacks: stacks-192454.txt)"}}))
    report = diagnose_run(run)
    assert report.flightrec is not None and report.flightrec.culprits == (3,) and report.found
    res = _invoke(str(run))
    assert "Flight recorder: group 0 diverges at collective #45: ranks 0-2 entered all_reduce [1000] Float" in res.output
    assert "rank 3 (vm, pid 17422) entered #45 as barrier" in res.output and "skip.py:22" in res.output
    assert json.loads(_invoke(str(run), "--json").output)["flightrec"]["culprits"] == [3]


# ---------------------------------------------------------------------------
# one log of many ranks: torchrun's (or accelerate's) own exception at the end
# is the launcher relaying an exit, not the program's


_TORCHRUN_TAIL = """\
E1127 10:01:02.123000 1234 torch/distributed/elastic/multiprocessing/api.py:874] failed (exitcode: {code}) local_rank: {rank} (pid: 1240) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "/usr/local/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "/usr/local/lib/python3.10/dist-packages/torch/distributed/launcher/api.py", line 263, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-27_10:01:02
  host      : gpu07
  rank      : {rank} (local_rank: {rank})
  exitcode  : {code} (pid: 1240)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""

_RANK3_KEYERROR = """\
[rank3]: Traceback (most recent call last):
[rank3]:   File "/home/u/train.py", line 40, in <module>
[rank3]:     batch = next(it)["input_ids"]
[rank3]: KeyError: 'input_ids'
"""

_RANK0_ECHO = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/home/u/train.py", line 44, in <module>
[rank0]:     loss.backward()
[rank0]: RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.4]:38574. This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error.
"""


def test_a_torchrun_log_shows_the_ranks_exception_not_childfailederror(tmp_path, monkeypatch):
    monkeypatch.setattr(prefilter, "CHUNK", 61)  # both tracebacks cut by block boundaries
    log = tmp_path / "slurm-812.out"
    log.write_text("step 1\n" * 50 + _RANK3_KEYERROR + _TORCHRUN_TAIL.format(code=1, rank=3))
    exc = last_exception(log)
    assert (exc.text, exc.rank, exc.line, exc.user_frame.line) == ("KeyError: 'input_ids'", 3, 54, 40)
    assert exc.launcher.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError")
    assert dict(exc.summary) == {"host": "gpu07", "rank": "3", "local_rank": "3", "exitcode": "1"}


def test_torchruns_root_cause_rank_is_shown_first_and_the_others_echo_is_its_consequence(tmp_path):
    log = tmp_path / "slurm-812.out"
    log.write_text(_RANK3_KEYERROR + _RANK0_ECHO + _TORCHRUN_TAIL.format(code=1, rank=3))
    result = _invoke(str(log))
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert "1. rank 3 on gpu07 failed first: KeyError: 'input_ids' (train.py:40)" in out
    assert "2. Consequence of the first failure: A peer rank went away" in out
    data = json.loads(_invoke(str(log), "--json").output)
    assert data["first_error"]["rank"] == 3 and data["exception"]["launcher"].endswith("ChildFailedError:")
    # without torchrun's summary naming rank 3 the echo stays the likely cause (nothing is guessed)
    log.write_text(_RANK3_KEYERROR + _RANK0_ECHO)
    data = json.loads(_invoke(str(log), "--json").output)
    assert data["first_error"] is None and data["diagnoses"][0]["rule_id"] == "peer-process-exited"
    # a summary naming the echoing rank (another node's torchrun ended last): no rank is promoted
    log.write_text(_RANK3_KEYERROR + _RANK0_ECHO + _TORCHRUN_TAIL.format(code=1, rank=0))
    data = json.loads(_invoke(str(log), "--json").output)
    assert data["first_error"] is None and data["diagnoses"][0]["rule_id"] == "peer-process-exited"


def test_the_root_cause_rank_is_found_behind_every_other_ranks_echo(tmp_path):
    echoes = "".join(_RANK0_ECHO.replace("[rank0]", f"[rank{r}]") for r in range(4, 52))
    log = tmp_path / "slurm-812.out"
    log.write_text(_RANK3_KEYERROR + "step 9\n" * 3000 + echoes + _TORCHRUN_TAIL.format(code=1, rank=3))
    data = json.loads(_invoke(str(log), "--json").output)
    assert (data["first_error"]["rank"], data["first_error"]["log_line"]) == (3, 4)


@pytest.mark.parametrize("prefix", ["0: ", "[default{}]:"])  # srun --label; torchrun --tee (local ranks)
def test_the_root_cause_rank_is_found_under_srun_and_tee_prefixes(tmp_path, prefix):
    log = tmp_path / "slurm-812.out"
    text = _RANK3_KEYERROR + _RANK0_ECHO + _TORCHRUN_TAIL.format(code=1, rank=3)
    if "{}" in prefix:
        text = text.replace("[rank3]: ", prefix.format(3)).replace("[rank0]: ", prefix.format(0))
    else:
        text = "".join(prefix + line for line in text.splitlines(keepends=True))
    log.write_text(text)
    data = json.loads(_invoke(str(log), "--json").output)
    assert (data["first_error"]["rank"], data["first_error"]["exception"]) == (3, "KeyError: 'input_ids'")
    assert data["diagnoses"][0]["consequence"]


def test_a_rank_that_exited_without_a_traceback_is_named_from_torchruns_summary(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("epoch 1\nworking\n" + _TORCHRUN_TAIL.format(code=3, rank=2))
    result = _invoke(str(log))
    assert result.exit_code == 1, result.output
    out = " ".join(result.output.split())
    assert "rank 2 on gpu07 exited with code 3 (torchrun's summary at the log's end, line 9); it printed " \
           "no Python traceback here" in out
    assert "sys.exit(N)" in out and "ChildFailedError" not in out and "NCCL_DEBUG" not in out
    data = json.loads(_invoke(str(log), "--json").output)
    assert data["exception"]["summary"] == {"host": "gpu07", "rank": "2", "local_rank": "2", "exitcode": "3"}


def test_accelerates_calledprocesserror_is_the_launcher_a_scripts_own_is_not(tmp_path):
    user = ('Traceback (most recent call last):\n  File "/home/u/train.py", line 5, in <module>\n'
            "    main()\nValueError: learning rate must be positive\n")
    launcher = (
        'Traceback (most recent call last):\n  File "/usr/local/bin/accelerate", line 8, in <module>\n'
        "    sys.exit(main())\n"
        '  File "/usr/local/lib/python3.10/dist-packages/accelerate/commands/launch.py", line 763, in '
        "simple_launcher\n    raise subprocess.CalledProcessError(returncode=process.returncode, cmd=cmd)\n"
        "subprocess.CalledProcessError: Command '['/usr/bin/python3', 'train.py']' returned non-zero "
        "exit status 1.\n")
    log = tmp_path / "a.log"
    log.write_text(user + launcher)
    exc = last_exception(log)
    assert exc.text == "ValueError: learning rate must be positive" and exc.launcher.startswith("subprocess.")
    out = " ".join(_invoke(str(log)).output.split())
    assert "The log ends with the launcher's CalledProcessError; before it, the program's own exception: " \
           "ValueError: learning rate must be positive (train.py:5)" in out
    # a script's own subprocess failure is its exception
    own = launcher.replace("/usr/local/lib/python3.10/dist-packages/accelerate/commands/launch.py",
                           "/home/u/prep.py")
    log.write_text(user + own)
    assert last_exception(log).type == "subprocess.CalledProcessError"
