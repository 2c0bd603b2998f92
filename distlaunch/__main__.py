"""``python -m distlaunch`` and the ``distlaunch`` console script (pyproject's entry point).

Light on purpose: an engine's agent (``distlaunch agent``) needs none of the CLI's imports
(click), and inside a Slurm allocation ``run`` may start the agent step before them
(``remote.srun.start_early``), so both commands reach this module before ``cli``; the
common form of ``run`` (one node, or the head over a Slurm allocation) needs no click
at all (``preparse``).
"""

import os
import sys


def main() -> None:
    """Dispatch: the agent's entry, or the click CLI (``cli.main``; exits the process)."""
    if sys.argv[1:] == ["agent"]:
        from .agent.entry import main as agent_main

        agent_main()
        return
    try:
        if sys.argv[1:2] == ["run"]:
            if "SLURM_JOB_ID" in os.environ:
                # the head over a Slurm allocation: the agent step may start before anything else
                from .remote.srun import start_early

                start_early(sys.argv[2:])
            # the common form, without click (it declines anything else)
            from .preparse import main as quick_main

            quick_main(sys.argv[1:])
        from .cli import main as cli_main

        cli_main()
    except KeyboardInterrupt as e:  # Ctrl-C while the CLI loads, before its own handling:
        from .command import leave, report_abort  # as click's Abort (no traceback of the

        leave(report_abort(e))  # imports); leave() ends an early agent step


if __name__ == "__main__":
    main()
