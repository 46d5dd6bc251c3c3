"""The session half of Sandbox's API: persistent shells, by name (a mixin, like files.py)."""

from __future__ import annotations

from typing import cast

from minisandbox.errors import SessionError
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT
from minisandbox.sandbox.session import SessionHost, ShellSession


class SessionOperations:
    """Named ShellSessions of one sandbox. What it needs of the sandbox is its `id`,
    `require_running()` and what ShellSession needs (SessionHost): a Sandbox is all three."""

    id: str
    _sessions: dict[str, ShellSession]

    def require_running(self) -> None:
        raise NotImplementedError

    async def create_session(
        self,
        name: str = "default",
        *,
        env: dict[str, str] | None = None,
        max_output: int | None = DEFAULT_MAX_OUTPUT,
        columns: int = 200,
        rows: int = 50,
    ) -> ShellSession:
        """Start a persistent interactive bash (its own pty) and return its ShellSession:
        `env` is added to its environment, `max_output` caps what one command returns,
        `columns` and `rows` size its terminal. It is closed with the sandbox, or by its
        `close()` or `close_session(name)`.

        Raises:
            SessionError: a session of that name exists, or the shell did not start.
            SandboxNotRunningError: the sandbox is not running.
            SandboxLimitError: the sandbox was stopped for exceeding a limit.
            CommandTimeoutError: the shell did not show its first prompt in time.
        """
        if name in self._sessions:
            raise SessionError(f"session {name!r} already exists in sandbox {self.id}")
        self.require_running()
        # The class that mixes this in is the SessionHost (checked where Sandbox is defined).
        host = cast(SessionHost, self)
        session = ShellSession(
            host,
            name,
            env=env,
            max_output=max_output,
            columns=columns,
            rows=rows,
            on_close=self._forget_session,
        )
        self._sessions[name] = session
        try:
            await session.start()
        except BaseException:
            await session.close()
            raise
        return session

    def _forget_session(self, session: ShellSession) -> None:
        if self._sessions.get(session.name) is session:
            del self._sessions[session.name]

    def session(self, name: str = "default") -> ShellSession:
        """The open session `name`.

        Raises:
            SessionError: there is no such session (never created, or closed).
        """
        try:
            return self._sessions[name]
        except KeyError:
            raise SessionError(f"no session {name!r} in sandbox {self.id}") from None

    @property
    def sessions(self) -> list[str]:
        """The names of the open sessions."""
        return list(self._sessions)

    async def close_session(self, name: str) -> None:
        """Close session `name`: its shell and everything in its process group are killed.

        Raises:
            SessionError: there is no such session.
        """
        await self.session(name).close()

    async def _close_sessions(self) -> None:
        for session in list(self._sessions.values()):
            await session.close()
        self._sessions.clear()
