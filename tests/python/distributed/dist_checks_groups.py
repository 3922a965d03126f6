"""Checks of tutel.system and of process groups: the data/model split, subgroups, 2DH."""
import os
import tempfile

import torch
import torch.distributed as dist

import dist_reference as ref
from dist_checks import CheckList, close, compare_with_reference, expect_error, rank, world
from tutel import net, system
from tutel.collectives import exchange
from tutel.collectives import simple_collectives as collectives

checks = CheckList()


@checks.add
def session_fields_and_helpers():
    env = system.get_local_session()
    assert (env.global_size, env.global_rank, env.group_count) == (world(), rank(), 1), env
    assert (env.model_size, env.model_rank, env.data_rank) == (world(), rank(), 0), env
    assert env.is_distributed and not env.is_cuda and env.local_device == torch.device("cpu"), env
    assert env.global_group is dist.group.WORLD and env.model_group is dist.group.WORLD
    assert isinstance(system.record_time(), float) and isinstance(system.record_time(is_cuda=False), float)
    system.cache().reset()
    system.cache().set("l_aux/0", 1.5)
    system.cache().set("l_aux/1", 2.5)
    assert system.cache().get("l_aux/1") == 2.5 and sorted(system.cache().get("unknown")) == [1.5, 2.5]
    with tempfile.TemporaryDirectory() as directory:
        pattern = os.path.join(directory, "ckpt-{size}", "part-{rank}.npy")
        path = system.apply_rank_size_from_pattern(pattern, rank(), world())
        assert path == os.path.join(directory, f"ckpt-{world()}", f"part-{rank()}.npy") and os.path.isdir(
            os.path.dirname(path))
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            value = ref.seeded("save", rank(), [2, 3]).mul(10).to(dtype)
            system.save(value, path)
            loaded = system.load(path)
            assert torch.equal(loaded.to(dtype), value), (dtype, loaded, value)
    env.dist_print(f"dist_print from rank {rank()}")


@checks.add
def data_and_model_groups():
    w = world()
    for count in sorted({1, 2, w, -1, -w} if w % 2 == 0 else {1, w}):
        env = net.create_groups_from_world(count)
        groups = count if count > 0 else w // -count
        model_size = w // groups
        assert (env.group_count, env.model_size) == (groups, model_size), (count, env)
        assert (env.model_rank, env.data_rank) == (rank() % model_size, rank() // model_size), (count, env)
        model_members = [env.data_rank * model_size + m for m in range(model_size)]
        data_members = [d * model_size + env.model_rank for d in range(groups)]
        assert dist.get_process_group_ranks(env.model_group) == model_members, (count, model_members)
        assert dist.get_process_group_ranks(env.data_group) == data_members, (count, data_members)
        assert net.create_groups_from_world(count) is env, "layouts are cached"
        compare_with_reference(f"all_to_all over the model group ({count})",
                               lambda r: ref.seeded(f"mg{count}", r, [model_size * 2, 3]),
                               lambda x: net.all_to_all(x, 1, 0, group=env.model_group),
                               lambda xs: ref.all_to_all(xs, 1, 0), group_ranks=model_members)
        compare_with_reference(f"all_gather over the data group ({count})",
                               lambda r: ref.seeded(f"dg{count}", r, [2]),
                               lambda x: net.all_gather(x, 0, fused=True, group=env.data_group),
                               lambda xs: ref.all_gather(xs, 0), group_ranks=data_members)
    if w > 1:
        expect_error(ValueError, ["group_count", "does not divide", str(w)], net.create_groups_from_world, w + 1)
        expect_error(ValueError, ["group_count", "allowed"], net.create_groups_from_world, -(w + 1))
    expect_error(ValueError, ["group_count"], net.create_groups_from_world, 0)
    expect_error(ValueError, ["backend", "allowed"], net.create_groups_from_world, 1, include_init="tcp")


@checks.add
def group_ranks_and_all_reduce_max_int():
    """net.group_ranks lists a group's global ranks in group order; all_reduce_max_int is the
    largest host integer over a group (WORLD, the model and data groups, a strided group)."""
    w = world()
    assert net.group_ranks() == list(range(w)) and net.group_ranks(dist.group.WORLD) == list(range(w))
    value = 7 * ((rank() * 5 + 3) % w) - 2  # a different largest rank than the last one
    expected = max(7 * ((r * 5 + 3) % w) - 2 for r in range(w))
    result = net.all_reduce_max_int(value, torch.device("cpu"))
    assert result == expected and isinstance(result, int), (result, expected)
    assert net.all_reduce_max_int(-3 - rank(), torch.device("cpu")) == -3  # negative values
    if w % 2 == 0:
        env = net.create_groups_from_world(2)
        model_members = [env.data_rank * (w // 2) + m for m in range(w // 2)]
        data_members = [d * (w // 2) + env.model_rank for d in range(2)]
        assert net.group_ranks(env.model_group) == model_members
        assert net.group_ranks(env.data_group) == data_members
        for group, members in ((env.model_group, model_members), (env.data_group, data_members)):
            assert net.all_reduce_max_int(100 + rank(), torch.device("cpu"), group) == 100 + max(members)


@checks.add
def host_integers_through_a_gloo_group_of_the_same_processes():
    """For a group whose backend takes no CPU tensors (NCCL), all_reduce_max_ints makes a gloo
    group over the same processes (they alone take part) and reduces the host integers there:
    the same maxima, for WORLD and for subgroups, the gloo group made once per group."""
    w = world()
    real = collectives._takes_cpu_tensors
    collectives._takes_cpu_tensors = lambda group: False  # every group as if it were NCCL-only
    try:
        values = [3 * rank() - 1, -rank(), 5]
        assert collectives.all_reduce_max_ints(values) == [3 * (w - 1) - 1, 0, 5]
        made = dict(collectives._CPU_GROUPS)
        assert dist.get_process_group_ranks(made[dist.group.WORLD]) == list(range(w))
        assert collectives.all_reduce_max_ints([rank()]) == [w - 1]
        assert collectives._CPU_GROUPS == made  # kept, not made again
        if w % 2 == 0:
            env = net.create_groups_from_world(2)
            members = [d * (w // 2) + env.model_rank for d in range(2)]
            assert collectives.all_reduce_max_ints([100 + rank()], env.data_group) == [100 + max(members)]
            assert dist.get_process_group_ranks(collectives._CPU_GROUPS[env.data_group]) == members
    finally:
        collectives._takes_cpu_tensors = real
        collectives._CPU_GROUPS.clear()


@checks.add
def splitting_a_proper_subgroup():
    w = world()
    everyone = dist.new_group(list(range(w)))  # the same ranks as WORLD, but another group
    for count in (1, -1) + ((2, -2) if w % 2 == 0 else ()):
        env = net.create_groups_from_world(count, parent_group=everyone)
        model_size = w // env.group_count
        assert env.global_group is everyone and env.global_size == w
        model_members = [env.data_rank * model_size + m for m in range(model_size)]
        assert dist.get_process_group_ranks(env.model_group) == model_members
        close(net.simple_all_reduce(torch.tensor([float(rank())]), group=env.model_group),
              torch.tensor([float(sum(model_members))]), f"all_reduce over a split subgroup ({count})")
    if w >= 4:
        # Ranks {0, 2} and {1, 3} split their own (strided) parents at the same time.
        parent = net.create_groups_from_world(2).data_group
        members = dist.get_process_group_ranks(parent)
        env = net.create_groups_from_world(-1, parent_group=parent)
        assert env.global_size == 2 and env.model_size == 1 and net.get_world_size(env.data_group) == 2
        compare_with_reference("all_to_all over a split strided subgroup",
                               lambda r: ref.seeded("strided", r, [4, 2]),
                               lambda x: net.all_to_all(x, 0, 1, group=env.data_group),
                               lambda xs: ref.all_to_all(xs, 0, 1), group_ranks=members)
        first_pair, second_pair = dist.new_group([0, 1]), dist.new_group([2, 3])
        outsider = first_pair if rank() >= 2 else second_pair
        expect_error(ValueError, ["not a member", "group"], net.get_world_size, outsider)
    alone = net.create_standalone_group()
    assert net.get_world_size(alone) == 1
    close(net.simple_all_reduce(torch.tensor([2.0]), group=alone), torch.tensor([2.0]), "standalone group")


@checks.add
def two_dimensional_hierarchical_all_to_all_equals_flat():
    w = world()
    hierarchy = exchange.hierarchy_of(None)
    local_size = int(os.environ.get("LOCAL_SIZE") or os.environ["LOCAL_WORLD_SIZE"])
    if 1 < local_size < w:
        assert hierarchy is not None and (hierarchy.local_size, hierarchy.nodes) == (local_size, w // local_size)
    else:
        assert hierarchy is None, "one host (or one process per host): 2DH is the flat exchange"
    groups = [None, dist.new_group(list(range(w)))]
    if w >= 4:
        groups.append(net.create_groups_from_world(2).data_group)
    shape = [2 * w, 3, w]
    for index, group in enumerate(groups):
        members = dist.get_process_group_ranks(group) if group is not None else list(range(w))
        for input_dim, output_dim in ((1, 0), (0, 2), (2, 2)):
            inputs = [ref.seeded(f"2dh/{index}", r, shape) for r in members]
            x = inputs[members.index(rank())].clone().requires_grad_()
            flat = net.all_to_all(x, input_dim, output_dim, group=group)
            x2 = x.detach().clone().requires_grad_()
            hierarchical = net.all_to_all(x2, input_dim, output_dim, group=group, use_2dh=True)
            assert torch.equal(flat, hierarchical), f"2DH != flat for group {members} dims {input_dim, output_dim}"
            close(flat, ref.all_to_all(inputs, input_dim, output_dim)[members.index(rank())], "flat all_to_all")
            grad = ref.seeded("2dh-grad", rank(), flat.shape)
            flat.backward(grad)
            hierarchical.backward(grad)
            assert torch.equal(x.grad, x2.grad), f"2DH gradient != flat for group {members}"
            background = net.all_to_all(x.detach(), input_dim, output_dim, group=group, use_2dh=True,
                                        background=True)
            assert torch.equal(background(), flat.detach()), "2DH in the background"


@checks.add
def timeout_setting_is_validated():
    previous = os.environ.get("TUTEL_GLOBAL_TIMEOUT_SEC")
    try:
        for bad in ("soon", "-3", "0", "inf"):
            os.environ["TUTEL_GLOBAL_TIMEOUT_SEC"] = bad
            expect_error(ValueError, ["TUTEL_GLOBAL_TIMEOUT_SEC", "positive"], net.create_standalone_group)
    finally:
        os.environ["TUTEL_GLOBAL_TIMEOUT_SEC"] = previous


@checks.add
def splitting_after_unequal_group_histories_is_reported():
    # Must stay the last check that splits a subgroup: afterwards rank 0 has one group more.
    if world() == 1:
        return
    parent = dist.new_group(list(range(world())))
    if rank() == 0:
        net.create_standalone_group()
    expect_error(RuntimeError, ["different numbers of process groups", "parent_group"],
                 net.create_groups_from_world, 1, parent_group=parent)
