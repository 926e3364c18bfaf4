from tdlm.training.planner.cli import main

raise SystemExit(main())
