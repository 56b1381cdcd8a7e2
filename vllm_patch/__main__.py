from vllm_patch.cli import main

raise SystemExit(main())
