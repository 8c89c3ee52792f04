"""The transaction that writes a sharded directory: staged by the coordinator, a file per rank, published whole.

::

    save = DirectorySave(open_directory(path), overwrite=True)
    token = save.begin()                        # coordinator: checks, clears stale stagings, stages
    result = save.write_rank(token, "__0.nvckpt", state, options)   # every rank, into the staging
    save.finish(token, {".metadata": ..., MANIFEST: ...})           # coordinator: the last files, then publish
    save.abandon(token)                         # any failure: nothing of this save stays

Readers see the complete old checkpoint or the complete new one, never a mix
(``nvckpt.io.directory``); a front-end (``nvckpt.dcp.Writer``) decides what goes
in the files and when each step runs.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import NvckptError
from ..io.directory import SAVES, Directory, Staging
from ..options import SaveOptions
from .layout import MANIFEST, METADATA, user_entry


def checkpoint_entry(name: str) -> bool:
    """An entry that says a directory holds a checkpoint (its manifest, or DCP's metadata)."""
    return name in (METADATA, MANIFEST)


class DirectorySave:
    """One save of a sharded directory (see the module docstring).  ``overwrite``: replace a checkpoint there
    (entries that are not the checkpoint's own, a user's config, carry over); a directory holding other files
    is never replaced.  Saves to one directory in this process publish newest-started last (nvckpt.io.publish)."""

    def __init__(self, directory: Directory, *, overwrite: bool = True) -> None:
        self.directory = directory
        self.overwrite = overwrite
        self.number = SAVES.number()  # started: an older save to this path finishing later does not replace it
        self._begun: dict[str, Staging] = {}  # the coordinator's stagings, held (alive) until finished or abandoned

    def restart(self) -> None:
        """The same object for a new save (a front-end's writer used again)."""
        self.number = SAVES.number()

    def check(self) -> None:
        """Raise now (FileExistsError naming the directory) if this save could not publish there."""
        self.directory.check_replaceable(checkpoint_entry, self.overwrite)

    def begin(self) -> str:
        """The coordinator's first step: check the target, remove what failed saves left (not a staging this
        process is still writing), stage.  Returns the staging's token, which every rank writes into."""
        self.check()
        self.directory.remove_stale()
        staging = self.directory.stage()
        self._begun[staging.token] = staging
        return staging.token

    def _staging(self, token: str) -> Staging:
        return self._begun.get(token) or self.directory.staging(token)

    def write_rank(self, token: str, name: str, state: Any, options: SaveOptions) -> Any:
        """Save ``state`` as the staged file ``name`` (``nvckpt.save``'s way: the engines, the same bytes);
        returns its SaveResult.  Errors name the file as it will be once published."""
        from ..session.save import SaveSession  # torch: only where a rank writes

        staging = self._staging(token)
        if not staging.alive():  # made by the coordinator before the plan; removed as a rank failed
            raise self.abandoned_error(name)
        try:
            return SaveSession(state, staging.target(name), options).run()
        except (OSError, NvckptError):
            if not staging.alive():
                raise self.abandoned_error(name) from None
            raise

    def size(self, token: str, name: str) -> int:
        return self._staging(token).size(name)

    def finish(self, token: str, files: dict[str, bytes], carry: Callable[[str], bool] | None = user_entry) -> None:
        """The coordinator's last step: write ``files`` (name -> bytes: the metadata, the manifest last), then
        publish the staged checkpoint.  On any error nothing of this save stays."""
        staging = self._staging(token)
        try:
            for name, data in files.items():
                staging.write_bytes(name, data)
            staging.publish(self.number, carry)
        except BaseException:
            staging.discard()
            raise
        finally:
            self._begun.pop(token, None)

    def abandon(self, token: str | None) -> None:
        """This save failed and can no longer publish: its staging goes, with whatever the ranks wrote there."""
        if token is not None:
            self._staging(token).discard()
            self._begun.pop(token, None)

    def abandoned_error(self, name: str) -> NvckptError:
        return NvckptError(f"the save was abandoned while this rank wrote {name}: another rank failed (its error "
                           "says why), or this rank does not see the coordinator's staging (every rank must write "
                           "to one shared filesystem or store)", path=self.directory.name)


__all__ = ["DirectorySave", "checkpoint_entry"]
