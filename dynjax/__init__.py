"""dynjax: train dynamic LLMs in JAX, kept fast by recompiling a static Plan in the background.

The public entry point is ``python -m dynjax.train --config configs/<name>.py``; see README.md.
"""

__version__ = "0.1.0"
