"""What every room of the package stands on, importing nothing of it above: the user-error
class, files local or behind a scheme (gs://), the device and its mesh, the terminal and the
commands' argument handling."""
