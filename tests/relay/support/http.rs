//! The relay's HTTP endpoints as a test reads them: raw GETs and
//! Prometheus series.

use std::time::Duration;

/// A minimal HTTP/1.1 GET on 127.0.0.1: (status, body), `None` if nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    // The bodies here are small and sent whole; undo chunked framing if used.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).ok()?;
            if n == 0 {
                break;
            }
            out.push_str(after.get(..n)?);
            rest = after.get(n + 2..)?;
        }
        out
    } else {
        body.to_owned()
    };
    Some((status, body))
}

/// The value of a Prometheus series: `name{a="x",b="y"}` with labels in any order.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    fn parse(series: &str) -> (String, Vec<String>) {
        match series.split_once('{') {
            Some((name, labels)) => {
                let mut l: Vec<String> = labels
                    .trim_end_matches('}')
                    .split(',')
                    .filter(|x| !x.is_empty())
                    .map(str::to_owned)
                    .collect();
                l.sort();
                (name.to_owned(), l)
            }
            None => (series.to_owned(), Vec::new()),
        }
    }
    let wanted = parse(series);
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        (parse(series) == wanted)
            .then(|| value.parse().ok())
            .flatten()
    })
}

/// The sum of a metric's series, whatever their labels.
pub fn metric_sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|l| l.strip_prefix(name)?.strip_prefix('{')?.rsplit_once(' '))
        .filter_map(|(_, v)| v.parse::<f64>().ok())
        .sum()
}
