"""The services that get images: image name -> py_binary. One line per service.

Add a line when a service's main lands; its target must be visible to //images.
"""

SERVICES = {
    "launcher": "//services/launcher:launch",
    "frontend": "//services/frontend:serve",
    "metrics_proxy": "//services/metrics_proxy:serve",
    # "control_plane": "//services/control_plane:serve",
}
