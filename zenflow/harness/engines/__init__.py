"""The engines: the registry (one row per engine), the classes behind the rows, and how a run builds one."""
