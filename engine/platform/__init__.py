"""The machine: the devices and the plan for them, CPU features, which native kernels run,
memory, graph capture and the compute thread."""
