"""Entry point for `fab`: Invoke looks for the task collection here before it reads fabric.yaml."""
from deploy.tasks import ns  # noqa: F401  (the collection Fabric serves)
