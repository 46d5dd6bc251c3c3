"""Tasks: the task model, loading tasks from each source, the bundled examples, and building a
task's layers."""
