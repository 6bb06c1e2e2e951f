from hetplan.cli import main

raise SystemExit(main())
