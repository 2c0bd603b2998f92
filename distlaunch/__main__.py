import os
import sys

if sys.argv[1:] == ["agent"]:  # an engine's agent: none of the CLI's imports (click)
    from .agent.entry import main as agent_main

    agent_main()
else:
    if sys.argv[1:2] == ["run"] and "SLURM_JOB_ID" in os.environ:
        # inside a Slurm allocation: the agent step may start before the CLI's imports
        from .remote.srun import start_early

        start_early(sys.argv[2:])
    from .cli import main

    main()
