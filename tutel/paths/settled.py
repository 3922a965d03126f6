"""Whether a call may take an answer kept from an earlier call like it (its path, its plan), and the
global states such an answer depends on.

The path a call takes follows from its facts (tutel.paths.facts), and the facts of an inference call
from its shapes and dtypes and from a few global states: the dispatch modes active (fake tensors, a
counting mode), the backend the environment asks for, the decode lines in effect, the chooser's
rules and whether a CUDA graph is being captured.  A call with autograd recording, traced by
torch.compile or under autocast takes no kept answer: its facts depend on more (which tensors
require grad, the autocast dtype), and its host cost is not a decoding step's.
"""
import os
from typing import Optional, Tuple

import torch

from ..ops import decode_lines
from ..ops.backend import BACKEND_VARIABLE
from ..ops.tracing import _COMPILER_IS_COMPILING
from ..rules import paths as path_rules
from ..rules.autocast import any_autocast

# (private, one C call each; absent on old PyTorch, where nothing is kept)
_DISPATCH_MODES = getattr(torch._C, "_len_torch_dispatch_stack", None)
_ACTIVE_MODE = getattr(torch._C, "_get_dispatch_mode", None)
_FAKE_KEY = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None) if _ACTIVE_MODE else None


def settled_state() -> Optional[Tuple[object, ...]]:
    """The global states a kept answer depends on, as a tuple to put in its key; None when this
    call must not take one (grad mode on, torch.compile tracing, autocast on, or a PyTorch without
    the dispatch-mode queries)."""
    if torch.is_grad_enabled() or _DISPATCH_MODES is None or \
            (_COMPILER_IS_COMPILING is not None and _COMPILER_IS_COMPILING()) or any_autocast():
        return None
    # (a CUDA graph being captured: the facts' `capturing`, which keeps calls off the paths that
    # read the host; inline, as tutel.paths.facts.stream_capturing asks it)
    return (_DISPATCH_MODES(), _FAKE_KEY is not None and _ACTIVE_MODE(_FAKE_KEY) is not None,
            os.environ.get(BACKEND_VARIABLE), decode_lines.overrides, id(path_rules.RULES),
            torch.cuda._initialized and torch.cuda.is_current_stream_capturing())
