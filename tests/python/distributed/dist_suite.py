"""Every check of the distributed suite, run in one launch (process start-up is the main cost)."""
import dist_checks
import dist_checks_collectives
import dist_checks_groups
import dist_checks_optimizer
import dist_checks_variable
from dist_harness import init_gloo

# The groups' checks come last: their final check leaves unequal group histories behind.
CHECK_LISTS = (dist_checks_collectives.checks, dist_checks_variable.checks, dist_checks_optimizer.checks,
               dist_checks_groups.checks)


def check_names():
    return [name for checks in CHECK_LISTS for name in checks.names()]


def run_all():
    """Joins the process group with tutel.system.init_data_model_parallel (gloo) and runs every check."""
    init_gloo()
    dist_checks.run(CHECK_LISTS)
