"""paved_images: every service x flavour image, its push, and one //images:push for all."""

load("//tools/build_defs:oci.bzl", "oci_image", "oci_push", "oci_push_all", "py_image_layer")

# One lock per flavour (the only place its versions are set), the base the lock pins, and the
# compatibility report the push requires. The images take no version argument of their own.
FLAVOURS = {
    "cpu": struct(lock = "cpu.lock.toml", base = ":base_cpu", compat = ":compat_cpu"),
    "gpu": struct(lock = "gpu.lock.toml", base = ":base_gpu", compat = ":compat_gpu"),
}

def paved_service_image(name, service, binary, flavour, base = None):
    """The `flavour` image of one service (its layer is :<service>_layer), on the flavour's base
    or on `base` (which must be the same image: the lock pins its digest)."""
    f = FLAVOURS[flavour]
    oci_image(
        name = name,
        base = base or f.base,
        tars = [":%s_layer" % service],
        lock = f.lock,
        compat_report = f.compat,
        labels = {
            "org.opencontainers.image.title": "paved %s (%s)" % (service, flavour),
            "org.paved.service": service,
            "org.paved.service.target": str(binary),
        },
        ref_name = "paved/%s/%s" % (flavour, service),
    )

def paved_images(services):
    """services: {image name: py_binary label}. Per service: one runfiles layer shared by the
    flavours; per flavour: `<name>_<flavour>` (an OCI layout) and `push_<name>_<flavour>`;
    then `push`, which pushes them all (repositories paved/<flavour>/<name>)."""
    pushes = []
    for name, binary in services.items():
        py_image_layer(
            name = name + "_layer",
            binary = binary,
            root = "/app/" + name,
        )
        for flavour in FLAVOURS:
            image = "%s_%s" % (name, flavour)
            paved_service_image(image, name, binary, flavour)
            oci_push(
                name = "push_" + image,
                image = ":" + image,
                repository = "paved/%s/%s" % (flavour, name),
            )
            pushes.append(":push_" + image)
    oci_push_all(
        name = "push",
        pushes = pushes,
    )
