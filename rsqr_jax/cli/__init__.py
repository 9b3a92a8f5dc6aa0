"""The command-line applications: the streaming chat (`chat`), the main commands as `main(argv)` (`decode`,
`eval_stream`, `eval_tasks`; installed as rsqr-decode, rsqr-eval-stream, rsqr-eval-tasks) and the plumbing
every command shares (`args`). The studies' command lines are scripts/ in a checkout."""
