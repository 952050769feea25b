"""Starting dynjax on several processes: ``python -m dynjax.launch.local`` and the process set-up
that ``dynjax.train`` runs first."""
