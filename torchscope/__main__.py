from torchscope.cli import main

raise SystemExit(main())
