//! How an admin command reaches the controller: `Conn`, the flags that say where it is (its state
//! directory on its machine, or its address with a credential and the CA from elsewhere), the
//! admin client they give, and the runtime the command's requests run on.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use trellis_client::AdminClient;
use trellis_controller::state;

/// How an admin command finds the controller.
#[derive(Args, Clone)]
pub struct Conn {
    /// The controller's state directory, on the machine it runs on
    #[arg(long, global = true, conflicts_with = "server")]
    state_dir: Option<PathBuf>,
    /// The controller's address (HOST:PORT or https://...) from elsewhere; needs --admin-token-file and --ca-file
    #[arg(long, global = true, requires_all = ["admin_token_file", "ca_file"])]
    server: Option<String>,
    /// A file holding the admin credential (the controller's admin.token)
    #[arg(long, global = true)]
    admin_token_file: Option<PathBuf>,
    /// The mesh CA certificate (the controller's ca.pem)
    #[arg(long, global = true)]
    ca_file: Option<PathBuf>,
}

impl Conn {
    /// The state directory named, if the command runs on the controller's machine.
    pub(crate) fn state_dir(&self) -> Option<&Path> {
        self.state_dir.as_deref()
    }

    pub(crate) fn client(&self) -> Result<AdminClient> {
        match (&self.state_dir, &self.server) {
            (Some(dir), _) => {
                let (host, ca, token) = state::StateDir::load(dir)?.admin_access()?;
                Ok(AdminClient::new(&trellis_client::base_url(&host), &ca, &token)?)
            }
            (None, Some(server)) => Ok(AdminClient::from_args(
                server,
                self.admin_token_file.as_ref().expect("required"),
                self.ca_file.as_ref().expect("required"),
            )?),
            (None, None) => {
                bail!("say where the controller is: --state-dir DIR on its machine, or --server HOST:PORT --admin-token-file F --ca-file F")
            }
        }
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("tokio runtime")
}
