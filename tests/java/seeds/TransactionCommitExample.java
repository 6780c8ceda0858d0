/*
 * The example program of a RocketMQ transaction-message article, as a user writes it: a TransactionMQProducer whose
 * TransactionListener commits, set after start(), one message, then shutdown(). The article's code is kept as it is;
 * added are the imports, the class around its main, the logger it uses (java.util.logging, which prints to standard
 * error), and the name server address, taken from -Dnamesrv instead of the article's 127.0.0.1:9876.
 *
 * Run against Apache RocketMQ 4.9.8 and against txmq by tests/test_rocketmq_article_examples.py.
 */

import java.util.logging.Logger;

import org.apache.rocketmq.client.exception.MQClientException;
import org.apache.rocketmq.client.producer.LocalTransactionState;
import org.apache.rocketmq.client.producer.TransactionListener;
import org.apache.rocketmq.client.producer.TransactionMQProducer;
import org.apache.rocketmq.common.message.Message;
import org.apache.rocketmq.common.message.MessageExt;

public class TransactionCommitExample {
    private static final Logger logger = Logger.getLogger("TransactionCommitExample");

    public static void main(String[] args) throws MQClientException {
        logger.info("producer start ...");
        TransactionMQProducer producer = new TransactionMQProducer("ProducerGroupName1");
        producer.setNamesrvAddr(System.getProperty("namesrv"));//外网地址
        producer.start();

        producer.setTransactionListener(new TransactionListener() {
            @Override
            public LocalTransactionState executeLocalTransaction(Message msg, Object arg) {
                logger.info("执行本地事务");
                return LocalTransactionState.COMMIT_MESSAGE;
            }

            @Override
            public LocalTransactionState checkLocalTransaction(MessageExt msg) {
                logger.info("检查本地事务");
                return LocalTransactionState.COMMIT_MESSAGE;
            }
        });


        Message message = new Message("TopicTest3", "TAGA", "测试事务消息".getBytes());
        producer.sendMessageInTransaction(message, null);

        producer.shutdown();
    }
}
