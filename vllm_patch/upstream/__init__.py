"""``vllm-patch pr``: a carried patch as a commit on a branch of a vLLM
checkout, with a pull request description carrying measured evidence
(``pr`` drives; ``pr_body`` writes the text; ``pr_format`` checks the layout;
``vllm_tests`` runs vLLM's own tests; ``meta`` reads a patch's ``[upstream]``
table)."""
