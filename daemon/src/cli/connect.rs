//! Which daemon a client subcommand talks to: the `--socket`/`--config` flags
//! they share, resolved to a socket path ($STOKER_SOCKET or the default when
//! neither is given) and connected to.

use std::path::PathBuf;

use stoker_client::Client;

use crate::config::Config;

/// Which daemon a client subcommand talks to.
#[derive(Debug, clap::Args)]
pub(super) struct Target {
    /// Daemon socket (default: $STOKER_SOCKET, else the config's, else /run/stoker/stoker.sock).
    #[arg(long, short)]
    socket: Option<PathBuf>,
    /// Read the socket path from this config file.
    #[arg(long, short)]
    config: Option<PathBuf>,
}

impl Target {
    /// The daemon at `socket`.
    pub(super) fn at(socket: PathBuf) -> Target {
        Target { socket: Some(socket), config: None }
    }

    /// The daemon's socket: `--socket`, else the one `--config` names, else the default.
    pub(super) fn socket_path(&self) -> anyhow::Result<PathBuf> {
        Ok(match (&self.socket, &self.config) {
            (Some(s), _) => s.clone(),
            (None, Some(c)) => Config::load(c)?.server.socket,
            (None, None) => Client::default_socket(),
        })
    }

    /// A connection to the daemon at [`Target::socket_path`].
    pub(super) fn connect(&self) -> anyhow::Result<Client> {
        Ok(Client::connect(self.socket_path()?)?)
    }
}
