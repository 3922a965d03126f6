"""Checkpoint files: per-rank file patterns, and state dicts nested inside a file (``--namespace``)."""
import argparse
import logging
import os
import pickle
import sys
from typing import Any, Callable, List, Mapping, Optional, Tuple

import torch


def rank_files(pattern: str, world_size: int, what: str = "pattern") -> List[str]:
    """The file of every rank: ``{rank}`` and ``{size}`` in `pattern` replaced (Tutel's convention)."""
    if world_size < 1:
        raise ValueError(f"the number of files must be >= 1, got {world_size}")
    if world_size > 1 and "{rank}" not in pattern:
        raise ValueError(f"{what} {pattern!r} has no `{{rank}}`: the {world_size} processes' files would all be "
                         f"the same file")
    return [pattern.replace("{rank}", str(rank)).replace("{size}", str(world_size)) for rank in range(world_size)]


def _path(namespace: Optional[str]) -> List[str]:
    return [part for part in (namespace or "").split("/") if part]


def read_file(path: str, trust_pickle: bool = False) -> Any:
    """torch.load on the CPU; only tensors and plain containers unless `trust_pickle`."""
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust_pickle)
    except pickle.UnpicklingError as error:
        raise ValueError(f"{path} holds Python objects other than tensors and plain containers ({error}); load it "
                         f"with trust_pickle=True (--trust_pickle) only if you trust where it comes from") from None


def inner_state(content: Any, namespace: Optional[str], path: str) -> Mapping[str, torch.Tensor]:
    """The state dict at `namespace` ('a/b' = content['a']['b']) of a loaded file."""
    state = content
    walked = []
    for part in _path(namespace):
        if not isinstance(state, Mapping) or part not in state:
            keys = sorted(state)[:10] if isinstance(state, Mapping) else type(state).__name__
            raise ValueError(f"{path}: no entry {part!r} under {'/'.join(walked) or 'the top level'} "
                             f"(namespace {namespace!r}); found: {keys}")
        state = state[part]
        walked.append(part)
    if not isinstance(state, Mapping):
        raise ValueError(f"{path}: {namespace or 'the file'} is a {type(state).__name__}, not a state dict")
    return state


def with_inner_state(content: Any, namespace: Optional[str], state: Mapping) -> Any:
    """A copy of `content` whose state dict at `namespace` is replaced by `state` (other entries kept)."""
    parts = _path(namespace)
    if not parts:
        return state
    top = dict(content)
    node = top
    for part in parts[:-1]:
        node[part] = dict(node[part])
        node = node[part]
    node[parts[-1]] = state
    return top


def read_states(files: List[str], namespace: Optional[str], trust_pickle: bool = False,
                wanted: Optional[set] = None) -> Tuple[List[Optional[Mapping]], Optional[Any]]:
    """The state dicts of `files` (None for a missing file, or one not in `wanted` indices),
    and the whole content of the first file read."""
    states: List[Optional[Mapping]] = []
    first = None
    for index, path in enumerate(files):
        if (wanted is not None and index not in wanted) or not os.path.exists(path):
            states.append(None)
            continue
        content = read_file(path, trust_pickle)
        if first is None:
            first = content
        states.append(inner_state(content, namespace, path))
    return states, first


def write_file(content: Any, path: str) -> None:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    torch.save(content, path)


def command_line_parser(module_doc: str, program: str, required) -> argparse.ArgumentParser:
    """A parser with the `required` (flag, type, help) options, --namespace and --trust_pickle."""
    parser = argparse.ArgumentParser(prog=f"python3 -m {program}", description=module_doc.splitlines()[0])
    for flag, kind, text in required:
        parser.add_argument(flag, type=kind, required=True, help=text)
    add_file_flags(parser)
    return parser


def add_file_flags(parser: argparse.ArgumentParser) -> None:
    """--namespace and --trust_pickle, shared by the gather and scatter command lines."""
    parser.add_argument("--namespace", type=str, default="",
                        help="where the state dict sits in each file, e.g. model or a/b")
    parser.add_argument("--trust_pickle", action="store_true",
                        help="allow any pickled object in the files (only for files you trust)")


def run_command_line(program: str, work: Callable[[], None]) -> None:
    """Runs `work`, turning the conversion's errors into one line on stderr and exit status 1."""
    logging.basicConfig(format="%(levelname)s: %(message)s")
    try:
        work()
    except (ValueError, FileNotFoundError) as error:
        sys.exit(f"{program}: error: {error}")
