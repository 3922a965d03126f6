"""Former location of :mod:`tutel.collectives.autograd_collectives`, kept as a re-export so imports written
against it keep working; new code imports from :mod:`tutel.collectives`."""
from ..collectives.autograd_collectives import *  # noqa: F401,F403
