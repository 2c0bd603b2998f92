import sys

if sys.argv[1:] == ["agent"]:  # an engine's agent: none of the CLI's imports (click)
    from .agent.entry import main as agent_main

    agent_main()
else:
    from .cli import main

    main()
