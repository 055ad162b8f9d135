//! What the read-only verbs share: `-o table|json`, and the agent's health
//! server as a client sees it.

use anyhow::Context as _;
use serde_json::Value;

/// Prints `value` as JSON, or the table `table` renders.
pub(super) fn print(output: &str, value: Value, table: impl FnOnce() -> String) -> anyhow::Result<()> {
    match output {
        "json" => println!("{}", serde_json::to_string_pretty(&value)?),
        "table" => print!("{}", table()),
        other => anyhow::bail!("-o {other}: expected table or json"),
    }
    Ok(())
}

/// GET `path` from the agent's health server at `addr`: (status, JSON body).
pub(super) fn agent_get(addr: &str, path: &str) -> anyhow::Result<(u16, Value)> {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr)
        .with_context(|| format!("cannot reach the agent's health server at {addr} (--health-address)"))?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Ok((status, serde_json::from_str(body).unwrap_or(Value::Null)))
}
