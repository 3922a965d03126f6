"""tutel.net / tutel.system in one process without torch.distributed, and their pure helpers."""
import contextlib
import logging
import os
import re

import pytest
import torch

from tutel import net, system
from tutel.collectives import exchange, process_groups
from tutel.collectives.distributed_optimizer import is_expert_param

RENDEZVOUS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "OMPI_COMM_WORLD_SIZE",
                        "OMPI_COMM_WORLD_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE")


@pytest.fixture
def no_rendezvous(monkeypatch):
    for name in RENDEZVOUS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not process_groups.is_distributed(), "these tests need a process without torch.distributed"


def test_world_of_one(no_rendezvous):
    assert (net.get_world_size(), net.get_world_rank()) == (1, 0)
    env = net.create_groups_from_world(1)
    assert (env.global_size, env.global_rank, env.model_size, env.data_rank, env.is_distributed) == (1, 0, 1, 0, False)
    assert env.model_group is None and env.data_group is None and env.global_group is None
    assert net.create_standalone_group() is None
    net.barrier()
    with pytest.raises(ValueError, match="group_count=2 does not divide the group size 1"):
        net.create_groups_from_world(2)


def test_collectives_of_one_process_return_their_input(no_rendezvous):
    x = torch.randn(4, 6, requires_grad=True)
    for output in (net.all_to_all(x, 1, 0), net.all_to_all(x, 0, 1, background=True)(), net.all_gather(x, 1),
                   net.spatial_split(x, 0), net.reduce_scatter(x, 1), net.allreduce_forward(x),
                   net.allreduce_backward(x), net.simple_all_to_all(x), net.simple_split(x),
                   net.simple_reduce_scatter(x), net.simple_all_gather(x)):
        assert output is x
    reduced = net.simple_all_reduce(x)
    assert reduced is not x and torch.equal(reduced, x)
    assert torch.equal(net.zero_gather(x.reshape(-1), [3, 8]), x.reshape(3, 8))
    datas = [torch.arange(6), torch.ones(2, 3)]
    outputs, sizes = net.batch_all_to_all_v(datas, [6])
    assert outputs[0] is datas[0] and outputs[1] is datas[1] and sizes.tolist() == [6]
    outputs, sizes = net.batch_all_gather_v(datas)
    assert outputs[1].shape == (6,) and sizes.tolist() == [6]
    with pytest.raises(ValueError, match="partition_sizes.*exactly one per rank"):
        net.batch_all_to_all_v(datas, [3, 3])


def test_init_data_model_parallel_falls_back_to_one_process(no_rendezvous, caplog):
    with caplog.at_level(logging.CRITICAL):
        with pytest.warns(RuntimeWarning, match="nccl.*gloo") if not torch.cuda.is_available() else \
                contextlib.nullcontext():
            env = system.init_data_model_parallel(backend="nccl")
    assert "Registering device global rank 0: data_rank = 0, model_rank = 0" in caplog.text
    assert system.get_local_session() is env and env.is_distributed is False
    expected_device = "cuda" if torch.cuda.is_available() else "cpu"
    assert env.local_device.type == expected_device and env.is_cuda == (expected_device == "cuda")
    assert isinstance(system.record_time(), float)
    with pytest.raises(ValueError, match="backend='tcp' is not supported"):
        system.init_data_model_parallel(backend="tcp")


def test_record_time_without_a_session(monkeypatch):
    monkeypatch.setattr(system, "_session", None)
    with pytest.raises(RuntimeError, match="init_data_model_parallel"):
        system.record_time()
    assert isinstance(system.record_time(is_cuda=False), float)


def test_rendezvous_configuration(monkeypatch, no_rendezvous):
    assert process_groups.rendezvous_kind() == "none"
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert process_groups.rendezvous_kind() == "openmpi"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert process_groups.rendezvous_kind() == "none"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert process_groups.rendezvous_kind() == "env"
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        process_groups.initialize_process_group("gloo")


def test_timeout_and_local_size_settings(monkeypatch, no_rendezvous):
    monkeypatch.delenv("TUTEL_GLOBAL_TIMEOUT_SEC", raising=False)
    assert process_groups.global_timeout().total_seconds() == 86400
    monkeypatch.setenv("TUTEL_GLOBAL_TIMEOUT_SEC", "2.5")
    assert process_groups.global_timeout().total_seconds() == 2.5
    monkeypatch.setenv("TUTEL_GLOBAL_TIMEOUT_SEC", "never")
    with pytest.raises(ValueError, match="TUTEL_GLOBAL_TIMEOUT_SEC='never'.*positive number"):
        process_groups.global_timeout()
    assert process_groups.local_size_from_env() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert process_groups.local_size_from_env() == 4
    monkeypatch.setenv("LOCAL_SIZE", "8")
    assert process_groups.local_size_from_env() == 8
    monkeypatch.setenv("LOCAL_SIZE", "-8")
    with pytest.raises(ValueError, match="LOCAL_SIZE='-8'"):
        process_groups.local_size_from_env()


def test_members_per_host_decides_the_2dh_factorisation():
    assert exchange.members_per_host([0, 1, 2, 3], 2) == 2
    assert exchange.members_per_host([0, 1, 2, 3, 4, 5, 6, 7], 4) == 4
    assert exchange.members_per_host([0, 2, 4, 6], 2) == 1          # one member per host
    assert exchange.members_per_host([0, 1, 2, 4], 2) is None       # hosts hold 2, 1 and 1 members
    assert exchange.members_per_host([0, 2, 1, 3], 2) is None       # hosts interleaved in rank order


def test_cache_save_load_and_file_patterns(tmp_path, caplog):
    cache = system.cache()
    cache.reset()
    cache.set("a", 1)
    cache.set("b", [2])
    assert cache.get("a") == 1 and cache.get("missing") == [1, [2]] and cache.get() == [1, [2]]
    cache.reset()
    assert cache.get("a") == []
    value = torch.randn(3, 4).to(torch.bfloat16)
    path = str(tmp_path / "value.npy")
    system.save(value, path)
    assert torch.equal(system.load(path).to(torch.bfloat16), value)
    pattern = str(tmp_path / "run-{size}" / "rank{rank}.pt")
    assert system.apply_rank_size_from_pattern(pattern, 3, 8) == str(tmp_path / "run-8" / "rank3.pt")
    assert os.path.isdir(tmp_path / "run-8")
    with caplog.at_level(logging.WARNING):
        system.apply_rank_size_from_pattern(str(tmp_path / "shared.pt"), 0, 2, create_dir=False)
    assert "{rank}" in caplog.text


def test_system_load_puts_the_tensor_on_the_device_asked_for(tmp_path):
    value = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = str(tmp_path / "value.npy")
    system.save(value, path)
    loaded = system.load(path, device="meta")  # any device other than the default CPU shows it was used
    assert loaded.device.type == "meta" and loaded.shape == (3, 4) and loaded.dtype == torch.float32
    assert torch.equal(system.load(path, device=torch.device("cpu")), value)


def test_all_reduce_max_int_and_group_ranks_in_one_process(no_rendezvous):
    assert net.all_reduce_max_int(5, torch.device("cpu")) == 5
    assert isinstance(net.all_reduce_max_int(torch.tensor(3), torch.device("cpu")), int)
    assert net.group_ranks() == [0]


@pytest.mark.parametrize("node_names,local_size,expected", [
    # more processes than nodes: consecutive local ranks share a node, spread evenly
    (["node0", "node1"], 4, [["0"], ["0"], ["1"], ["1"]]),
    (["node0", "node1", "node2"], 3, [["0"], ["1"], ["2"]]),
    # more nodes than processes: each local rank binds to every local_size-th node
    (["node0", "node1", "node2", "node3"], 2, [["0", "2"], ["1", "3"]]),
    # numeric order, other entries ignored
    (["node10", "node2", "node1", "possible", "has_cpu"], 3, [["1"], ["2"], ["10"]]),
])
def test_numa_binding_chooses_the_nodes_of_each_local_rank(tmp_path, monkeypatch, node_names, local_size, expected):
    from tutel.launcher import execl
    for name in node_names:
        (tmp_path / name).mkdir()
    numactl = tmp_path / "numactl"
    numactl.write_text("")
    monkeypatch.setattr(execl, "NUMA_ROOT", str(tmp_path))
    monkeypatch.setattr(execl, "NUMACTL", str(numactl))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for local_rank, nodes in enumerate(expected):
        assert execl.numa_binding(local_rank, local_size) == [str(numactl), f"--cpunodebind={','.join(nodes)}"]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # threads per process: no binding
    assert execl.numa_binding(0, local_size) == []
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(execl, "NUMACTL", str(tmp_path / "absent"))  # no numactl: no binding
    assert execl.numa_binding(0, local_size) == []


@pytest.mark.skipif(not os.path.isdir("/sys/devices/system/node/node0"), reason="no NUMA layout in /sys")
def test_numa_affinity_helper_binds_local_rank_0_to_node_0(monkeypatch):
    node0 = {int(name[3:]) for name in os.listdir("/sys/devices/system/node/node0") if re.fullmatch(r"cpu[0-9]+", name)}
    before = os.sched_getaffinity(0)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("NUMA_TYPE", "1")
    monkeypatch.delenv("TUTEL_CUDA_SANDBOX", raising=False)
    try:
        system.init_affinity_at_program_beginning()
        assert os.sched_getaffinity(0) == node0
    finally:
        os.sched_setaffinity(0, before)


def test_distributed_optimizer_in_one_process_equals_adam():
    torch.manual_seed(0)
    shared = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    expert = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))
    expert._tutel_expert = True
    assert is_expert_param(expert) and not is_expert_param(shared)
    reference = [torch.nn.Parameter(p.detach().clone()) for p in (shared, expert)]
    optimizer = net.TutelDistributedOptimizer([shared, expert]).warp_local(torch.optim.Adam, lr=0.1)
    plain = torch.optim.Adam(reference, lr=0.1)
    for _ in range(3):
        grads = [torch.randn_like(p) for p in reference]
        for param, grad in zip((shared, expert), grads):
            param.grad = grad.clone()
        for param, grad in zip(reference, grads):
            param.grad = grad.clone()
        optimizer.step()
        plain.step()
        optimizer.zero_grad()
    for param, expected in zip((shared, expert), reference):
        torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
    with pytest.raises(RuntimeError, match="warp_local"):
        net.TutelDistributedOptimizer([shared]).step()
