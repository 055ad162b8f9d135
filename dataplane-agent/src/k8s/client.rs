//! The Kubernetes API client of the agent's watchers and of the
//! load-balancer controllers: from a kubeconfig, the in-cluster
//! environment, or a bare `--k8s-api-server` URL.

use kube::{
    Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};

#[derive(Debug, thiserror::Error)]
#[error(
    "cannot build the Kubernetes client configuration: {0}. Pass --k8s-api-server URL (and --kubeconfig) or run in-cluster"
)]
pub struct ClientError(String);

pub async fn client(
    api_server: Option<String>,
    kubeconfig: Option<std::path::PathBuf>,
) -> Result<Client, ClientError> {
    let cfg_err = |e: &dyn std::fmt::Display| ClientError(e.to_string());
    let mut config = match &kubeconfig {
        Some(path) => {
            let kc = Kubeconfig::read_from(path).map_err(|e| cfg_err(&e))?;
            Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default())
                .await
                .map_err(|e| cfg_err(&e))?
        }
        None => match Config::infer().await {
            Ok(c) => c,
            // Nothing to infer from: talk to the given server without credentials.
            Err(e) => match &api_server {
                Some(url) => Config::new(url.parse().map_err(|e| cfg_err(&e))?),
                None => return Err(cfg_err(&e)),
            },
        },
    };
    // The `kubernetes` ClusterIP is served by this very agent: the API
    // server's real address must come from configuration.
    if let Some(url) = api_server {
        config.cluster_url = url.parse().map_err(|e| cfg_err(&e))?;
    }
    Client::try_from(config).map_err(|e| cfg_err(&e))
}
