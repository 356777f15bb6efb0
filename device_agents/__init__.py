"""edgekit-agent: runs signed edgekit bundles offline on a device.

Imports ``edgekit.bundle`` (the contract) and nothing else of ``edgekit``; loads no converter.
"""

__version__ = "0.1.0"
