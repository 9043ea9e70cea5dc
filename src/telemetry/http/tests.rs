//! The server's bounds, over real TCP connections on 127.0.0.1.

use super::{Health, Limits, serve};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const BOUND: Duration = Duration::from_secs(5);
const HALF_A_HEAD: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: relay\r\n";
const HEALTHZ: &[u8] = b"GET /healthz HTTP/1.1\r\nHost: relay\r\nConnection: close\r\n\r\n";

struct Server {
    address: std::net::SocketAddr,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

async fn start(limits: Limits) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let app = super::router(Arc::new(Health::default()), None);
    let task = tokio::spawn(serve(listener, app, limits, stop.clone()));
    Server {
        address,
        stop,
        task,
    }
}

async fn connect(server: &Server, bytes: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(server.address).await.unwrap();
    stream.write_all(bytes).await.unwrap();
    stream
}

/// What the server sends until it closes, within `within`; `None` when it
/// is still open then.
async fn answer(stream: &mut TcpStream, within: Duration) -> Option<String> {
    let mut got = Vec::new();
    match tokio::time::timeout(within, stream.read_to_end(&mut got)).await {
        Ok(_) => Some(String::from_utf8_lossy(&got).into_owned()),
        Err(_) => None,
    }
}

fn limits(connections: usize, head_within: Duration) -> Limits {
    Limits {
        connections,
        head_within,
        lifetime: Duration::from_secs(60),
        grace: Duration::from_millis(200),
    }
}

#[tokio::test]
async fn a_stop_does_not_wait_for_a_client_that_stalls() {
    let server = start(limits(4, Duration::from_secs(60))).await;
    let _stalled = connect(&server, HALF_A_HEAD).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    server.stop.cancel();
    tokio::time::timeout(BOUND, server.task)
        .await
        .expect("the server ends within the bound although a client stalls")
        .unwrap();
}

#[tokio::test]
async fn a_head_that_does_not_arrive_in_time_closes_the_connection() {
    let server = start(limits(4, Duration::from_millis(300))).await;
    let mut stalled = connect(&server, HALF_A_HEAD).await;
    let closed = answer(&mut stalled, BOUND).await;
    assert!(
        closed.is_some_and(|a| !a.contains("200 OK")),
        "a head not finished in time closes the connection unanswered"
    );
    let mut asked = connect(&server, HEALTHZ).await;
    let answered = answer(&mut asked, BOUND).await.unwrap_or_default();
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
    assert!(answered.ends_with("ok\n"), "{answered}");
    // Kept alive after an answer, then idle: closed as well.
    let mut idle = connect(&server, b"GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n").await;
    let answered = answer(&mut idle, BOUND).await;
    assert!(
        answered
            .as_deref()
            .is_some_and(|a| a.starts_with("HTTP/1.1 200")),
        "answered, then closed once idle: {answered:?}"
    );
}

#[tokio::test]
async fn connections_past_the_limit_wait_for_room() {
    let server = start(limits(1, Duration::from_secs(60))).await;
    let holding = connect(&server, HALF_A_HEAD).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut waiting = connect(&server, HEALTHZ).await;
    assert_eq!(
        answer(&mut waiting, Duration::from_millis(500)).await,
        None,
        "a connection past the limit is not served while the first holds the room"
    );
    drop(holding);
    let answered = answer(&mut waiting, BOUND).await.unwrap_or_default();
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
}

#[tokio::test]
async fn a_head_past_the_limit_is_refused() {
    let server = start(limits(4, Duration::from_secs(60))).await;
    let mut head = b"GET /healthz HTTP/1.1\r\nHost: relay\r\nX-Filler: ".to_vec();
    head.extend(std::iter::repeat_n(b'a', 4 * super::MAX_HEAD_BYTES));
    head.extend_from_slice(b"\r\n\r\n");
    let mut stream = TcpStream::connect(server.address).await.unwrap();
    // The server may close before it has read all of it.
    let _ = stream.write_all(&head).await;
    let answered = answer(&mut stream, BOUND).await;
    assert!(
        answered.as_deref().is_some_and(|a| !a.contains("200 OK")),
        "an oversized head is refused and the connection closed: {answered:?}"
    );
}

/// A connection that outlives `lifetime` (a client that stopped reading, or
/// trickles its head) is closed, and its room goes to the next.
#[tokio::test]
async fn a_connection_is_closed_at_the_end_of_its_lifetime() {
    let server = start(Limits {
        lifetime: Duration::from_millis(300),
        ..limits(1, Duration::from_secs(60))
    })
    .await;
    let mut holding = connect(&server, HALF_A_HEAD).await;
    assert!(answer(&mut holding, BOUND).await.is_some(), "closed");
    let mut next = connect(&server, HEALTHZ).await;
    let answered = answer(&mut next, BOUND).await.unwrap_or_default();
    assert!(answered.starts_with("HTTP/1.1 200"), "{answered}");
}
