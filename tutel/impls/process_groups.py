"""Former location of :mod:`tutel.collectives.process_groups`, kept as a re-export so imports written
against it keep working; new code imports from :mod:`tutel.collectives`."""
from ..collectives.process_groups import *  # noqa: F401,F403
