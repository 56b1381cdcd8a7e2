"""``python -m vllm_patch``: the ``vllm-patch`` command. Like ``python -m pip``
it imports from the working folder (``-m`` puts it first on ``sys.path``);
``python -P -m vllm_patch`` (3.11+) leaves that folder out."""

from vllm_patch.cli import main

raise SystemExit(main())
